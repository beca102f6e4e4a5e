"""What a rollout backend takes and returns; every backend (paged, dense, sglang-jax) speaks these."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

FinishReason = Literal["eos", "stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample one request's completions.

  temperature 0 is greedy. top_k 0 and top_p 1.0 are off. `n` completions share the prompt's prefill
  (the GRPO group). `seed` fixes the request's draws: token t of sample j uses key
  fold_in(fold_in(key(seed), j), t), so results do not depend on batching, slots or preemption.
  """

  max_new_tokens: int = 256
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  n: int = 1
  seed: int = 0
  stop_token_ids: tuple[int, ...] | None = None  # None: the engine's EOS ids
  stop_strings: tuple[str, ...] = ()  # needs a tokenizer; the completion ends with the token that
  # completes the string (kept, so its log-prob stays aligned)

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.n < 1:
      raise ValueError(f"n must be >= 1, got {self.n}")


@dataclasses.dataclass
class Completion:
  """One sampled completion.

  `logprobs[t]` is the log-probability of token t under the distribution it was drawn from (after
  temperature, top-k and top-p; for greedy, under the model's plain softmax).
  """

  prompt_index: int
  sample_index: int
  prompt_ids: np.ndarray  # [P] int32
  token_ids: np.ndarray  # [C] int32
  logprobs: np.ndarray  # [C] f32
  finish_reason: FinishReason
  queued_s: float = 0.0  # submission to first admission
  latency_s: float = 0.0  # submission to finish
  preemptions: int = 0


@dataclasses.dataclass
class RolloutStats:
  prompts: int = 0
  completions: int = 0
  generated_tokens: int = 0
  prefill_tokens: int = 0
  prefill_s: float = 0.0
  decode_s: float = 0.0
  total_s: float = 0.0
  decode_steps: int = 0
  preemptions: int = 0

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / self.total_s if self.total_s > 0 else 0.0


@dataclasses.dataclass
class RolloutResult:
  completions: list[Completion]  # ordered by (prompt_index, sample_index)
  stats: RolloutStats

  def padded(self, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([N, C] ids, [N, C] mask, [N, C] logprobs), right-padded with 0 to the longest completion (or
    `max_len`; a longer completion is an error, never cut)."""
    longest = max((len(c.token_ids) for c in self.completions), default=0)
    width = longest if max_len is None else max_len
    if longest > width:
      raise ValueError(f"a completion has {longest} tokens, more than max_len={width}")
    n = len(self.completions)
    ids, mask, lps = (
      np.zeros((n, width), np.int32),
      np.zeros((n, width), bool),
      np.zeros((n, width), np.float32),
    )
    for i, c in enumerate(self.completions):
      k = len(c.token_ids)
      ids[i, :k], mask[i, :k], lps[i, :k] = c.token_ids, True, c.logprobs
    return ids, mask, lps
