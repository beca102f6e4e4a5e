"""What a rollout backend takes and returns; every backend (paged, dense, sglang-jax) speaks these."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

FinishReason = Literal["eos", "stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample one request's completions.

  temperature 0 is greedy. top_k 0, top_p 1.0 and min_p 0.0 are off (rl.rollout.sampling: the kept
  set is the intersection of the filters, a threshold set; min_p keeps p_v >= min_p * p_max). `n` completions share the prompt's prefill
  (the GRPO group). `seed` fixes the request's draws: token t of sample j uses key
  fold_in(fold_in(key(seed), j), t), so results do not depend on batching, slots or preemption.
  """

  max_new_tokens: int = 256
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  n: int = 1
  seed: int = 0
  stop_token_ids: tuple[int, ...] | None = None  # None: the engine's EOS ids
  stop_strings: tuple[str, ...] = ()  # needs a tokenizer; the completion ends with the token that
  # completes the string (kept, so its log-prob stays aligned)

  def __post_init__(self):
    check_sampling(
      max_new_tokens=self.max_new_tokens,
      temperature=self.temperature,
      top_k=self.top_k,
      top_p=self.top_p,
      min_p=self.min_p,
      n=self.n,
      seed=self.seed,
    )
    if self.stop_token_ids is not None and not all(
      _is_int(t) and t >= 0 for t in self.stop_token_ids
    ):
      raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")


SEED_RANGE = (0, 2**32 - 1)  # a request's seed becomes a uint32 PRNG seed


def _is_int(x) -> bool:
  return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
  if not _is_int(value):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
  if value < lo or (hi is not None and value > hi):
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"{name} must be {allowed}, got {value}")


def check_sampling(
  *, max_new_tokens, temperature, top_k, top_p, min_p=0.0, n=1, seed=0, prefix: str = ""
) -> None:
  """The one check of sampling settings (SamplingParams; a config section may call it with
  `prefix="sampling."` so the error names its key): ValueError / TypeError naming the field and its
  allowed range. NaN fails every range."""
  _check_int(f"{prefix}max_new_tokens", max_new_tokens, 1)
  _check_int(f"{prefix}top_k", top_k, 0)  # 0 = off
  _check_int(f"{prefix}n", n, 1)
  _check_int(f"{prefix}seed", seed, *SEED_RANGE)
  for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
    if not isinstance(value, int | float | np.integer | np.floating) or isinstance(value, bool):
      raise TypeError(f"{prefix}{name} must be a number, got {type(value).__name__} {value!r}")
  if not (0.0 <= temperature < float("inf")):
    raise ValueError(f"{prefix}temperature must be finite and >= 0 (0 = greedy), got {temperature}")
  if not (0.0 < top_p <= 1.0):
    raise ValueError(f"{prefix}top_p must be in (0, 1] (1 = off), got {top_p}")
  if not (0.0 <= min_p <= 1.0):
    raise ValueError(f"{prefix}min_p must be in [0, 1] (0 = off), got {min_p}")


@dataclasses.dataclass
class Completion:
  """One sampled completion.

  `logprobs[t]` is the log-probability of token t under the distribution it was drawn from (after
  temperature, top-k, top-p and min-p; for greedy, under the model's plain softmax). `support_gaps[t]`
  is its support gap (kernels.support: the threshold of the set it was drawn from, in scaled
  logits, minus its own, <= 0; rl.rollout.sampling.gap_of; -inf where nothing was filtered or at temperature 0), or None for an engine that
  cannot report it (sglang_jax: the trainer replays the filter on its own logits).
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
  support_gaps: np.ndarray | None = None  # [C] f32, None: not reported


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

  def padded_gaps(self, max_len: int | None = None) -> np.ndarray | None:
    """[N, C] support gaps aligned with `padded`, -inf on padding; None when a completion has none
    (the engine cannot report them)."""
    if any(c.support_gaps is None for c in self.completions):
      return None
    longest = max((len(c.token_ids) for c in self.completions), default=0)
    gaps = np.full((len(self.completions), longest if max_len is None else max_len), -np.inf)
    for i, c in enumerate(self.completions):
      gaps[i, : len(c.support_gaps)] = c.support_gaps
    return gaps.astype(np.float32)
