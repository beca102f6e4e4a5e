"""The environment protocol the multi-turn orchestrator drives (one instance per episode)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: str  # shown to the model next turn (ignored once done)
  reward: float  # this turn's reward (placed on the turn's last model token by GAE)
  done: bool
  info: dict[str, Any] = dataclasses.field(default_factory=dict)  # "success": bool once done


class Environment(Protocol):
  """One episode at a time. `reset(seed)` starts the episode the seed names (same seed, same episode)
  and returns the first observation; `step(action)` takes the model's whole reply of one turn. An
  environment ends its own episode after `max_turns` steps; a malformed action is never an exception
  (it costs a turn and the observation says what was expected)."""

  max_turns: int

  def reset(self, seed: int) -> str: ...

  def step(self, action: str) -> StepResult: ...


def check_max_turns(max_turns) -> int:
  if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
    raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
  return max_turns
