"""The rollout engine's settings (one typed dataclass; the loop's config tree nests it)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kernels.paged_attention import IMPLS as ATTN_IMPLS
from rl.configlib import Range, check_ranges
from rl.rollout.paged_cache import group_pages

__all__ = ["BACKENDS", "MATMUL_PRECISIONS", "EngineConfig"]

BACKENDS = ("paged", "dense", "sglang_jax")
# the names jax.default_matmul_precision accepts
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Rollout engine settings.

  backend: "paged" (continuous batching on the paged KV cache), "dense" (a static batch on a dense
    cache, the way tunix / MLLM-JAX sample: the reference), "sglang_jax" (sglang-jax's Engine in this
    process, weights synced in memory: rl/rollout/sglang_jax.py; needs the `sglang` extra).
  max_seq_len: prompt + completion limit. A prompt that leaves no room for one new token is an error;
    a completion that reaches the limit finishes with reason "length".
  max_slots: sequences decoded together (paged) / rows per batch (dense).
  page_size, num_pages: the paged pool; num_pages None = enough for every slot at max_seq_len. A smaller
    pool is allowed: sequences then wait for pages, or the newest is preempted and later recomputed.
  steps_per_sync: decode steps per device call between host scheduling (finished slots are refilled at
    these boundaries; a slot that stops mid-chunk idles for the rest of it).
  attn_impl: the paged engine's decode attention, one of kernels.paged_attention's IMPLS: "xla" runs
    the model's own attention over the gathered pages (what the trainer and the dense engine run, so
    the log-probs match theirs), "pallas" / "mosaic_gpu" the paged kernels, "auto" Pallas on TPU/GPU,
    XLA on CPU.
  cache_dtype: None = the model's compute dtype.
  matmul_precision: None (the backend's default) or a `jax.default_matmul_precision` name, applied
    while the engine's steps are traced. It matters for f32 dots only: on GPU an f32 dot runs at TF32
    unless asked for "highest" (XLA:CPU always runs f32), so an f32 engine whose log-probs are checked
    against a teacher-forced forward sets "highest" there and in the check (bench.rollout.throughput does).
  sglang_mem_fraction: sglang_jax only: the fraction of device memory its weights + KV pool may take
    (None: sglang-jax's default). Its KV pool holds max_slots * max_seq_len tokens, its context
    length is max_seq_len and it runs at most max_slots requests at once.
  """

  backend: str = "paged"
  max_seq_len: int = 1024
  max_slots: int = 64
  page_size: int = 16
  num_pages: int | None = None
  steps_per_sync: int = 8
  attn_impl: str = "auto"
  cache_dtype: str | None = None
  sglang_mem_fraction: float | None = None
  matmul_precision: str | None = None

  RANGES: ClassVar[dict[str, Range]] = {
    "max_seq_len": Range(ge=1),
    "max_slots": Range(ge=1),
    "page_size": Range(ge=1),
    "steps_per_sync": Range(ge=1),
    "sglang_mem_fraction": Range(gt=0, le=1, optional=True),
  }
  # the values the string fields take (None is allowed where the default is None)
  CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
    "backend": BACKENDS,
    "attn_impl": ATTN_IMPLS,
    "matmul_precision": MATMUL_PRECISIONS,
  }

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"rollout backend must be one of {BACKENDS}, got {self.backend!r}")
    check_ranges(self, "EngineConfig")
    if self.attn_impl not in ATTN_IMPLS:
      raise ValueError(
        f"EngineConfig.attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}"
      )
    if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(
        f"EngineConfig.matmul_precision must be None or one of {MATMUL_PRECISIONS}, got "
        f"{self.matmul_precision!r}"
      )
    if self.cache_dtype is not None:
      try:
        jnp.dtype(self.cache_dtype)
      except TypeError as e:
        raise ValueError(
          f"EngineConfig.cache_dtype must be None or a dtype name, got {self.cache_dtype!r}"
        ) from e
    if self.num_pages is not None and self.num_pages - 1 < self.pages_per_seq:
      raise ValueError(
        f"num_pages={self.num_pages} cannot hold one sequence of max_seq_len="
        f"{self.max_seq_len} ({self.pages_per_seq} pages of {self.page_size} + the reserved "
        "page 0)"
      )

  def check_group(
    self, group_size: int, prompt_len: int | None = None, what: str = "a group"
  ) -> None:
    """ValueError unless a group of `group_size` samples of a `prompt_len`-token prompt can ever run
    (None: the longest prompt the engine accepts, max_seq_len - 1, so a config that passes never fails
    mid-run). Paged: a group is decoded together and admitted whole, so it needs `group_size` slots and
    `rollout.paged_cache.group_pages` pages of the pool at once; dense batches rows, sglang_jax
    schedules its own."""
    if self.backend != "paged":
      return
    plen = self.max_seq_len - 1 if prompt_len is None else prompt_len
    if group_size > self.max_slots:
      raise ValueError(
        f"{what} of {group_size} samples needs {group_size} decode slots, more than "
        f"max_slots={self.max_slots}: a group is decoded together"
      )
    need, usable = group_pages(plen, group_size, self.page_size), self.pool_pages - 1
    if need > usable:
      raise ValueError(
        f"{what} of {group_size} samples of a {plen}-token prompt needs {need} pages of "
        f"{self.page_size} tokens at once (the shared prompt + a last-page copy per sample), more "
        f"than the pool's {usable} (num_pages={self.pool_pages} with page 0 reserved): it could "
        f"never run; raise num_pages to >= {need + 1} or use fewer samples"
      )

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_seq_len // self.page_size)

  @property
  def pool_pages(self) -> int:
    return self.num_pages if self.num_pages is not None else self.max_slots * self.pages_per_seq + 1
