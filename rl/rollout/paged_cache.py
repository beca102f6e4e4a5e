"""The paged KV cache: a pool of fixed-size pages per layer, and each sequence's page table.

`PagedKVCache.attend` is the decoder's cache interface (rl.model.cache.KVCache). Prefill, and decode
with the XLA impl (`attn_impl="xla"`, or "auto" on CPU), gather the sequence's pages into a dense
context and run the model's own attention (`rl.model.cache.attention`, what the trainer's forward and
the dense engine run), so the engine's log-probs are the trainer's up to matmul shapes. Decode with a
kernel impl ("pallas", "mosaic_gpu", "auto" on TPU / GPU) runs `kernels.paged_attention` straight on
the pages. Why not the kernel's XLA reference on CPU: it keeps the softmax probabilities in f32 for the
PV product while the model rounds them to the compute dtype (as Hugging Face's attention does), which
in bf16 put the paged engine 3x further from a teacher-forced forward than the dense engine and made
its greedy completions diverge from dense (bench/paged_precision.py measures it).

Page 0 is never handed out: unused page-table entries point at it, so writes from padding tokens land
there and are never read into a result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels import backend
from kernels.paged_attention import gather_pages
from rl.model.cache import attention

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  k: jax.Array  # [L, Hkv, P, page_size, D]
  v: jax.Array  # [L, Hkv, P, page_size, D]
  page_table: jax.Array  # [B, pages_per_seq] int32: the pages of the B sequences of this call
  attn_impl: str = "auto"  # kernels.paged_attention impl for decode

  @classmethod
  def create(
    cls,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    attn_impl: str = "auto",
  ) -> PagedKVCache:
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return cls(
      jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((1, 1), jnp.int32), attn_impl
    )

  @property
  def page_size(self) -> int:
    return self.k.shape[3]

  def with_table(self, page_table) -> PagedKVCache:
    return dataclasses.replace(self, page_table=page_table)

  def attend(self, layer, q, k, v, positions):
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], positions [B, T] -> ([B, T, Hq, D], cache)."""
    ps = self.page_size
    capacity = self.page_table.shape[1] * ps
    slot_page = jnp.take_along_axis(
      self.page_table, jnp.minimum(positions // ps, capacity // ps - 1), axis=1
    )
    page = jnp.where(positions < capacity, slot_page, NULL_PAGE)  # [B, T]
    slot = positions % ps
    # Scalar layer and the [B, T] page/slot indices are separated by a slice, so numpy indexing puts
    # the [B, T] dims first: the update is k itself, [B, T, Hkv, D].
    new_k = self.k.at[layer, :, page, slot].set(k.astype(self.k.dtype))
    new_v = self.v.at[layer, :, page, slot].set(v.astype(self.v.dtype))
    cache = dataclasses.replace(self, k=new_k, v=new_v)
    if q.shape[1] == 1 and not self.model_attention:
      out = kernels.paged_attention(
        q[:, 0],
        new_k[layer],
        new_v[layer],
        positions[:, 0] + 1,
        self.page_table,
        impl=self.attn_impl,
      )
      return out[:, None].astype(q.dtype), cache
    kd = gather_pages(new_k[layer], self.page_table).transpose(0, 2, 1, 3)  # [B, S, Hkv, D]
    vd = gather_pages(new_v[layer], self.page_table).transpose(0, 2, 1, 3)
    slots = jnp.arange(kd.shape[1])
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
    # Slots no query of the row sees may hold a recycled page's stale values: a masked probability is
    # 0, but 0 * NaN = NaN, so they are zeroed (the visible ones, hence the result, are unchanged).
    seen = slots[None, :] <= jnp.max(positions, axis=1)[:, None]  # [B, S]
    vd = jnp.where(seen[:, :, None, None], vd, jnp.zeros((), vd.dtype))
    return attention(q, kd.astype(q.dtype), vd.astype(q.dtype), visible), cache

  @property
  def model_attention(self) -> bool:
    """Whether decode runs the model's attention over the gathered pages (the XLA impl) rather than
    the paged kernel; "auto" is XLA on CPU, as in `kernels.paged_attention` (resolved at trace time,
    so `kernels.backend.use_target` applies)."""
    return self.attn_impl == "xla" or (
      self.attn_impl == "auto" and backend.resolve().platform == "cpu"
    )


jax.tree_util.register_dataclass(
  PagedKVCache, data_fields=["k", "v", "page_table"], meta_fields=["attn_impl"]
)


class PagePool:
  """Host-side page accounting for one generate call: which pages are free, how many references each
  holds (a GRPO group shares its prompt's full pages), and how many pages a number of tokens takes."""

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 2:
      raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self.num_pages, self.page_size = num_pages, page_size
    self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
    self._refs = np.zeros(num_pages, np.int32)

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def usable(self) -> int:
    """Pages that can ever be handed out (all but the reserved page 0)."""
    return self.num_pages - 1

  def pages_for(self, tokens: int) -> int:
    return -(-tokens // self.page_size)

  def group_pages(self, prompt_len: int, n: int) -> int:
    return group_pages(prompt_len, n, self.page_size)

  def missing(self, pages: list[int], tokens: int) -> int:
    """Pages a sequence holding `pages` still needs to cache `tokens` tokens."""
    return max(self.pages_for(tokens) - len(pages), 0)

  def alloc(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(
        f"page pool exhausted: asked for {n}, {len(self._free)} free"
      )  # callers check
    pages = [self._free.pop() for _ in range(n)]
    self._refs[pages] = 1
    return pages

  def grow(self, pages: list[int], tokens: int) -> list[int]:
    """`pages` extended with fresh pages until they hold `tokens` tokens."""
    return pages + self.alloc(self.missing(pages, tokens))

  def alloc_group(self, prompt_len: int, n: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Page tables for the `n` samples of one prompt: they share its full pages; each sample after the
    first gets its own copy of the partial last page. Returns (tables, [(src, dst)] pages to copy
    once the first sample's pages hold the prefilled prompt)."""
    full, partial = divmod(prompt_len, self.page_size)
    lead = self.alloc(full + (partial > 0))
    tables, copies = [lead], []
    for _ in range(n - 1):
      self.share(lead[:full])
      own = self.alloc(1) if partial else []
      tables.append(lead[:full] + own)
      copies += [(lead[-1], own[0])] if partial else []
    return tables, copies

  def share(self, pages: list[int]) -> None:
    for p in pages:
      self._refs[p] += 1

  def release(self, pages: list[int]) -> None:
    for p in pages:
      if self._refs[p] <= 0:
        raise RuntimeError(f"page {p} released more often than allocated")
      self._refs[p] -= 1
      if self._refs[p] == 0:
        self._free.append(p)


def group_pages(prompt_len: int, n: int, page_size: int) -> int:
  """Pages `PagePool.alloc_group` takes: the prompt's pages once, plus a partial last page per extra
  sample. A group is admitted whole, so a pool with fewer usable pages can never run it."""
  full, partial = divmod(prompt_len, page_size)
  return full + (partial > 0) * n
