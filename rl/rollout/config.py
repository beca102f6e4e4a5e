"""The rollout engine's settings (one typed dataclass; the loop's config tree nests it)."""

from __future__ import annotations

import dataclasses

BACKENDS = ("paged", "dense", "sglang_jax")


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
  attn_impl: kernels.paged_attention impl for decode ("auto": Pallas on TPU/GPU, XLA on CPU).
  cache_dtype: None = the model's compute dtype.
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

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"rollout backend must be one of {BACKENDS}, got {self.backend!r}")
    for name in ("max_seq_len", "max_slots", "page_size", "steps_per_sync"):
      if getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.sglang_mem_fraction is not None and not 0.0 < self.sglang_mem_fraction <= 1.0:
      raise ValueError(
        f"EngineConfig.sglang_mem_fraction must be in (0, 1], got {self.sglang_mem_fraction}"
      )
    if self.num_pages is not None and self.num_pages - 1 < self.pages_per_seq:
      raise ValueError(
        f"num_pages={self.num_pages} cannot hold one sequence of max_seq_len="
        f"{self.max_seq_len} ({self.pages_per_seq} pages of {self.page_size} + the reserved "
        "page 0)"
      )

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_seq_len // self.page_size)

  @property
  def pool_pages(self) -> int:
    return self.num_pages if self.num_pages is not None else self.max_slots * self.pages_per_seq + 1
