"""The paged KV cache: a pool of fixed-size pages per layer, and each sequence's page table.

`PagedKVCache.attend` is the decoder's cache interface (rl.model.cache.KVCache). Prefill, and decode
with the XLA impl (`attn_impl="xla"`, or "auto" on CPU), gather the sequence's pages into a dense
context and run the model's own attention (`rl.model.cache.attention`, what the trainer's forward and
the dense engine run), so the engine's log-probs are the trainer's up to matmul shapes. Decode with a
kernel impl ("pallas", "mosaic_gpu", "auto" on TPU / GPU) runs `kernels.paged_attention` straight on
the pages. Why not the kernel's XLA reference on CPU: it keeps the softmax probabilities in f32 for the
PV product while the model rounds them to the compute dtype (as Hugging Face's attention does), which
in bf16 put the paged engine 3x further from a teacher-forced forward than the dense engine and made
its greedy completions diverge from dense (bench/rollout/paged_precision.py measures it).

Page 0 is never handed out: unused page-table entries point at it, so writes from padding tokens land
there and are never read into a result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels import backend
from kernels.paged_attention import gather_pages
from rl.kernel_sharding import paged_attention
from rl.model.cache import attention

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """The pool of every layer in one array per K / V: layer l's page p is row l * P + p of axis 1.

  Why one [Hkv, L * P, page_size, D] pool and not [L, Hkv, P, ...]: the kernel's page table can then
  address any layer's pages (offset by l * P), so each layer passes the whole pool, unsliced, to
  `kernels.paged_attention` (a `pool[layer]` operand of a custom call is a copy of that layer's whole
  pool per layer per step); and `layer` may be a traced int32 (the decoder's layers under
  `lax.scan`): it only shifts page ids, it never indexes a dimension. Writes are one scatter per layer
  into the carried, donated pool (in place).
  """

  k: jax.Array  # [Hkv, L * P, page_size, D]
  v: jax.Array  # [Hkv, L * P, page_size, D]
  page_table: jax.Array  # [B, pages_per_seq] int32: the pages (0..P-1) of the B sequences of a call
  attn_impl: str = "auto"  # kernels.paged_attention impl for decode
  num_layers: int = 1
  # None: k / v hold the values. A dtype name: k / v hold those values' bits as an unsigned integer
  # of the same width (the XLA decode path: see `_store`), viewed back wherever they are read.
  value_dtype: str | None = None
  # The decode kernel's layout in a program over several devices (rl.kernel_sharding.
  # decode_sharding; None: one device).
  kernel_sharding: Any = None

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
    sharding: jax.sharding.Sharding | None = None,  # of k / v; None: the default device
    kernel_sharding: Any = None,  # rl.kernel_sharding.decode_sharding of the decode's mesh
  ) -> PagedKVCache:
    shape = (num_kv_heads, num_layers * num_pages, page_size, head_dim)
    dtype = jnp.dtype(dtype)
    # Kept as bits only where XLA reads the pool (the gathers view the bits in their fusion): a
    # kernel takes the pool as a custom call's operand in its value dtype.
    bits = uses_model_attention(attn_impl)
    storage = _bits_dtype(dtype) if bits else dtype
    return cls(
      jnp.zeros(shape, storage, device=sharding),
      jnp.zeros(shape, storage, device=sharding),
      jnp.zeros((1, 1), jnp.int32),
      attn_impl,
      num_layers,
      dtype.name if bits else None,
      kernel_sharding,
    )

  @property
  def dtype(self):
    """The dtype of the cached values."""
    return jnp.dtype(self.value_dtype or self.k.dtype)

  def values(self, pool):  # [Hkv, N, page_size, D] storage -> the same in the value dtype
    return pool if self.value_dtype is None else jax.lax.bitcast_convert_type(pool, self.dtype)

  @property
  def page_size(self) -> int:
    return self.k.shape[2]

  @property
  def num_pages(self) -> int:
    """Pages per layer (P)."""
    return self.k.shape[1] // self.num_layers

  def with_table(self, page_table) -> PagedKVCache:
    return dataclasses.replace(self, page_table=page_table)

  def layer_pages(self, layer, pages):  # int or traced int32, [...] int32 -> [...] pool rows
    return pages + jnp.asarray(layer, jnp.int32) * self.num_pages

  def copy_pages(
    self, src, dst
  ) -> PagedKVCache:  # [M] int32 each: page src[i] -> dst[i], all layers
    rows = lambda p: self.layer_pages(jnp.arange(self.num_layers)[:, None], p[None]).reshape(-1)
    src, dst = rows(src), rows(dst)
    return dataclasses.replace(
      self, k=_store(self.k, dst, None, self.k[:, src]), v=_store(self.v, dst, None, self.v[:, src])
    )

  def attend(self, layer, q, k, v, positions, *, invariant=False):
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], positions [B, T] -> ([B, T, Hq, D], cache). `layer`: a
    Python int or a traced int32 scalar. `invariant` (ModelConfig.batch_invariant) needs the model's
    attention in decode: a paged kernel sums in its own order."""
    if invariant and not self.model_attention:
      raise ValueError(invariant_refusal(self.attn_impl))
    ps = self.page_size
    capacity = self.page_table.shape[1] * ps
    slot_page = jnp.take_along_axis(
      self.page_table, jnp.minimum(positions // ps, capacity // ps - 1), axis=1
    )
    page = jnp.where(positions < capacity, slot_page, NULL_PAGE)  # [B, T]
    table = self.layer_pages(layer, self.page_table)  # [B, pages_per_seq] rows of this layer
    rows = self.layer_pages(layer, page)
    new_k = _store(self.k, rows, positions % ps, k.astype(self.dtype))
    new_v = _store(self.v, rows, positions % ps, v.astype(self.dtype))
    cache = dataclasses.replace(self, k=new_k, v=new_v)
    new_k, new_v = self.values(new_k), self.values(new_v)
    if q.shape[1] == 1 and not self.model_attention:
      out = paged_attention(  # the decode kernel, shard-local over the rows on a mesh
        q[:, 0], new_k, new_v, positions[:, 0] + 1, table, self.attn_impl, self.kernel_sharding
      )
      return out[:, None].astype(q.dtype), cache
    kd = gather_pages(new_k, table).transpose(0, 2, 1, 3)  # [B, S, Hkv, D]
    vd = gather_pages(new_v, table).transpose(0, 2, 1, 3)
    slots = jnp.arange(kd.shape[1])
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
    # Slots no query of the row sees may hold a recycled page's stale values: a masked probability is
    # 0, but 0 * NaN = NaN, so they are zeroed (the visible ones, hence the result, are unchanged).
    seen = slots[None, :] <= jnp.max(positions, axis=1)[:, None]  # [B, S]
    vd = jnp.where(seen[:, :, None, None], vd, jnp.zeros((), vd.dtype))
    return attention(q, kd.astype(q.dtype), vd.astype(q.dtype), visible, invariant), cache

  @property
  def model_attention(self) -> bool:
    """Whether decode runs the model's attention over the gathered pages (the XLA impl) rather than
    the paged kernel; "auto" is XLA on CPU, as in `kernels.paged_attention` (resolved at trace time,
    so `kernels.backend.use_target` applies)."""
    return uses_model_attention(self.attn_impl)


def uses_model_attention(attn_impl: str) -> bool:
  return attn_impl == "xla" or (attn_impl == "auto" and backend.resolve().platform == "cpu")


def invariant_refusal(attn_impl: str) -> str | None:
  """Why ModelConfig.batch_invariant cannot decode through `attn_impl` here, or None: it needs the
  model's attention (a paged kernel sums in its own order)."""
  if uses_model_attention(attn_impl):
    return None
  return (
    "model batch_invariant=True needs the model's attention in decode: set attn_impl='xla' "
    f"(attn_impl={attn_impl!r} runs a paged kernel here, which sums in its own order)"
  )


def _bits_dtype(dtype):
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def _store(
  pool,  # [Hkv, N, page_size, D] values, or their bits
  rows,  # [...] int32 pool rows (axis 1)
  slots,  # [...] int32 slots in the page, or None: whole pages
  new,  # [..., Hkv, D] (slots) or [Hkv, M, page_size, D] (whole pages), in the value dtype / bits
):  # -> the pool with `new` written, in place when the pool is donated / carried
  """One scatter into the pool. On the XLA path the pool holds bits: XLA:CPU upcasts a bf16 scatter's
  whole operand to f32 and back (3 full copies of the pool per layer per step, the largest item of
  the old decode step's byte account) and copies the pool twice per step when a bf16 carry meets an
  integer scatter, while an integer scatter into an integer carry runs in place."""
  if new.dtype != pool.dtype:
    new = jax.lax.bitcast_convert_type(new, pool.dtype)
  if slots is None:
    return pool.at[:, rows].set(new)
  # Each (head, row, slot) is its own index and only the D values are a window. Indexing the heads
  # too keeps the pool in the kernel's layout: with the heads a window dimension ([:, rows, slots],
  # as before) the TPU compiler laid the scatter's result out heads-minor ({3,0,2,1}), and every
  # layer of every decode step converted the whole pool to the kernel's {3,2,1,0} and back (684 of
  # the 1.5B decode chunk's 739 GB accessed, compiled). The new values keep their [..., Hkv, D].
  heads = jnp.arange(pool.shape[0], dtype=jnp.int32).reshape((1,) * rows.ndim + (-1,))
  return pool.at[heads, rows[..., None], slots[..., None]].set(new)


# The cache's pytree split, one list for the class and every subclass a bench or test registers (a
# new field added here reaches them all).
PYTREE_FIELDS = dict(
  data_fields=["k", "v", "page_table"],
  meta_fields=["attn_impl", "num_layers", "value_dtype", "kernel_sharding"],
)
jax.tree_util.register_dataclass(PagedKVCache, **PYTREE_FIELDS)


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
