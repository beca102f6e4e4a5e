"""Evaluation: a sampled eval batch every few steps, and eval_full — the whole test split, greedy, pass@1.

Each process answers its own contiguous slice of the examples; counts are summed over processes, so
the accuracy is over every example exactly once whatever the process count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from tqdm import tqdm

from rl import sharding
from rl.data import Example, rewards
from rl.rollout import RolloutEngine, SamplingParams

__all__ = ["accuracy_change", "before_after_table", "binomial_se", "evaluate", "process_slice"]


def process_slice(n: int) -> slice:
  """This process's contiguous share of `n` items (the first `n % processes` processes take one more)."""
  process, processes = jax.process_index(), jax.process_count()
  base, extra = divmod(n, processes)
  start = process * base + min(process, extra)
  return slice(start, start + base + (process < extra))


def evaluate(
  engine: RolloutEngine,
  examples: Sequence[Example],
  encode: Callable[[str], list[int]],
  params: SamplingParams,
  *,
  chunk: int | None = None,
  progress: bool = False,
  desc: str = "eval",
) -> dict[str, float]:
  """Mean correctness and format reward of one completion per example, and the seconds it took.

  `params.n` must be 1 (pass@1). Examples are submitted `chunk` at a time (default: the engine's slots)
  so a progress bar can advance; the engine batches within a chunk.
  """
  if params.n != 1:
    raise ValueError(f"evaluation scores one completion per example (pass@1), got n={params.n}")
  t0 = time.perf_counter()
  mine = list(examples[process_slice(len(examples))])
  chunk = chunk or engine.config.max_slots
  correct = formatted = tokens = 0.0
  bar = tqdm(total=len(examples), desc=desc, disable=not progress, leave=False)
  for i in range(0, len(mine), chunk):
    part = mine[i : i + chunk]
    result = engine.generate([encode(e.question) for e in part], params)
    for completion, example in zip(result.completions, part):
      text = engine.tokenizer.decode(completion.token_ids)
      correct += rewards.correctness_reward(text, example.gold)
      formatted += rewards.format_reward(text)
      tokens += len(completion.token_ids)
    bar.update(len(part) * jax.process_count())
  bar.close()
  totals = sharding.allgather(np.array([[correct, formatted, tokens, len(mine)]], np.float64)).sum(
    axis=0
  )
  count = max(totals[3], 1.0)
  return {
    "accuracy": totals[0] / count,
    "format": totals[1] / count,
    "completion_length": totals[2] / count,
    "examples": totals[3],
    "seconds": time.perf_counter() - t0,
  }


def binomial_se(p: float, n: float) -> float:
  """The standard error of an accuracy p measured on n independent examples."""
  return math.sqrt(max(p * (1.0 - p), 0.0) / max(n, 1.0))


def accuracy_change(before: float, after: float, n: float) -> tuple[float, float]:
  """(after - before, that change in standard errors of the difference of two independent accuracies
  on n examples each). Both runs answer the same examples, so treating them as independent is
  conservative: the paired error is smaller."""
  se = math.hypot(binomial_se(before, n), binomial_se(after, n))
  diff = after - before
  return diff, (diff / se if se > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff)))


def before_after_table(before: Mapping[str, float], after: Mapping[str, float]) -> str:
  """eval_full before and after GRPO side by side (the rows `rl.step.eval_full` returns)."""
  n = after["eval_full/examples"]
  diff, z = accuracy_change(before["eval_full/accuracy"], after["eval_full/accuracy"], n)
  rows = [
    (
      "accuracy",
      before["eval_full/accuracy"],
      after["eval_full/accuracy"],
      f"{diff:+.3f} ({z:+.1f} SE)",
    ),
    ("format", before["eval_full/format"], after["eval_full/format"], ""),
    (
      "completion length",
      before["eval_full/completion_length"],
      after["eval_full/completion_length"],
      "",
    ),
  ]
  lines = [
    f"eval_full: {int(n)} examples, greedy pass@1",
    f"  {'':<18}{'before GRPO':>12}{'after GRPO':>12}  change",
  ]
  lines += [f"  {name:<18}{b:>12.3f}{a:>12.3f}  {note}".rstrip() for name, b, a, note in rows]
  return "\n".join(lines)
