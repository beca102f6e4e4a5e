"""Pallas paged decode attention, tiled family (Mosaic TPU, and the CPU interpreter of it): one query
token per sequence, keys and values scattered over pages.

For one (sequence b, kv head h, split s), the online softmax (:mod:`.softmax`) of the G = Hq / Hkv
query heads that share kv head h over the split's pages, so every K/V page is read once per kv head;
each split writes its normalised output and its log-sum-exp (`reference.combine_splits` merges them).

Grid (cores, items + 1): a parallel axis of 2 (megacore's two
TensorCores; 1 for an odd batch), then each core's (sequence, split) items in order, all kv heads in
one step, after a prologue step. The page table and lengths are scalar-prefetched; the K / V pools
stay in HBM (``pl.ANY``) and the kernel DMAs them itself into two [Hkv, pages_per_block, page_size,
D] VMEM slots each: one `make_async_copy` per page carries that page of every kv head (a strided
copy), ~6 scheduled bundles a page whatever Hkv. A literal-trip `fori_loop` walks the item's blocks:
block i + 1's DMAs start before block i is waited on (one wait per K / V slot: DMA semaphores count
bytes) and computed, and the next item's first block starts before this item's last one is waited on
(an SMEM scalar carries its slot), so only a core's prologue waits for HBM. Blocks past the length
skip their DMAs and compute; the block holding the length is peeled out of the loop, and only there
are scores masked and V zeroed past it (a recycled page's stale NaN / inf).
Compiled, libtpu 0.0.42.1, modelled (v6e, decode-4k: B 64, 16 q / 2 kv heads, D 128, ctx 4096,
1024-token blocks; bundles x steps / clock vs 0.146 ms of HBM time): page 16 -> 0.137 ms, page 64
-> 0.087 ms, page 128 -> 0.079 ms of compute: memory bound at every page size (the per-page
BlockSpec version it replaced: 3.65 / 1.03 / 0.60 ms, ~95 bundles per page input per step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend
from kernels.paged_attention.pallas_blocks import PagedConfig
from kernels.paged_attention.softmax import MASK, finish, online_update

LANES = 128  # the tiled family keeps per-row statistics broadcast over one lane tile
DMA_UNROLL = 64  # the TPU page-DMA loop's unroll: the scalar address math of many pages packs


def _start_block(refs, row, slot, ppb, unroll):
  """Start the DMAs of the block whose first page id is pages_ref[row] into ``slot``: one per page for
  K and V, each carrying that page of every kv head (a strided copy), K and V on one semaphore each."""
  pages_ref, k_hbm, v_hbm, k_buf, v_buf, sems = refs
  pltpu = backend._tpu_module()

  def page(j, c):
    pid = pages_ref[row + j]
    pltpu.make_async_copy(k_hbm.at[:, pid], k_buf.at[slot, :, j], sems.at[0, slot]).start()
    pltpu.make_async_copy(v_hbm.at[:, pid], v_buf.at[slot, :, j], sems.at[1, slot]).start()
    return c

  lax.fori_loop(0, ppb, page, 0, unroll=min(ppb, unroll))


def _wait_block(refs, slot):
  """One wait per K / V for a whole block's page DMAs: DMA semaphores count bytes."""
  _, _, _, k_buf, v_buf, sems = refs
  for which, buf in enumerate((k_buf, v_buf)):
    backend._tpu_module().make_async_copy(buf.at[slot], buf.at[slot], sems.at[which, slot]).wait()


def _update_block(q_ref, k_buf, v_buf, stats, slot, valid, scale):
  """The online-softmax step of every kv head over the block in ``slot``; ``valid`` = (the block's
  first position, the length): mask the slots past the length (None: every slot is valid)."""
  m_sc, l_sc, acc_sc = stats
  bk, d = k_buf.shape[2] * k_buf.shape[3], k_buf.shape[4]
  mask = mask_kv = None
  if valid is not None:
    start, length = valid
    mask = start + lax.broadcasted_iota(jnp.int32, (q_ref.shape[1], bk), 1) < length
    mask_kv = start + lax.broadcasted_iota(jnp.int32, (bk, d), 0) < length  # full tile
  for h in range(k_buf.shape[1]):
    m, l, acc = online_update(
      q_ref[h], k_buf[slot, h].reshape(bk, d), v_buf[slot, h].reshape(bk, d), mask, mask_kv,
      m_sc[h, :, :1], l_sc[h, :, :1], acc_sc[h], scale,
    )  # fmt: skip
    m_sc[h] = jnp.broadcast_to(m, m_sc.shape[1:])
    l_sc[h] = jnp.broadcast_to(l, l_sc.shape[1:])
    acc_sc[h] = acc


def _tiled_kernel(
  lengths_ref,
  pages_ref,
  q_ref,
  k_hbm,
  v_hbm,
  o_ref,
  lse_ref,
  *scratch,
  ppb,
  bps,
  splits,
  per_core,
  scale,
  unroll,
):
  k_buf, v_buf, sems, slot_ref, m_sc, l_sc, acc_sc = scratch  # k/v_buf [2, Hkv, ppb, page_size, D]
  refs = (pages_ref, k_hbm, v_hbm, k_buf, v_buf, sems)
  c, t = pl.program_id(0), pl.program_id(1)  # core c's step t: its work item t - 1; 0: a prologue
  bk = ppb * k_buf.shape[3]
  row_len = pages_ref.shape[0] // lengths_ref.shape[0]

  def item(w):
    """(sequence, split, index of its first page id, blocks holding a valid token) of item w >= 0
    (lax.div / rem: floor division's sign fix-up has no Mosaic scalar lowering)."""
    b, s = c * per_core + lax.div(w, splits), lax.rem(w, splits)
    start = jnp.maximum(lengths_ref[b] - s * bps * bk, 0)
    return b, s, b * row_len + s * bps * ppb, jnp.minimum(lax.div(start + bk - 1, bk), bps)

  b, s, row, n = item(jnp.maximum(t - 1, 0))
  n = jnp.where(t == 0, 0, n)
  length, first = lengths_ref[b], s * bps * bk
  _, _, next_row, next_n = item(jnp.minimum(t, per_core * splits - 1))  # the next step's item
  next_n = jnp.where(t < per_core * splits, next_n, 0)

  @pl.when(t == 0)
  def _():
    slot_ref[0] = 0

  slot0 = slot_ref[0]  # block i of this step lives in slot (slot0 + i) % 2

  def update(i, last):
    valid = None
    if last:  # the block holding the length: slots past it may be a recycled page's NaN / inf
      valid = (first + i * bk, length)
    _update_block(q_ref, k_buf, v_buf, (m_sc, l_sc, acc_sc), (slot0 + i) % 2, valid, scale)

  m_sc[...] = jnp.full(m_sc.shape, MASK, jnp.float32)
  l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def body(i, carry):  # blocks 0 .. n - 2: every slot valid; block i + 1 streams in meanwhile
    @pl.when(i < n - 1)
    def _():
      _start_block(refs, row + (i + 1) * ppb, (slot0 + i + 1) % 2, ppb, unroll)
      _wait_block(refs, (slot0 + i) % 2)
      update(i, last=False)

    return carry

  lax.fori_loop(0, bps - 1, body, 0)  # a literal trip count: blocks past the length skip their body

  @pl.when(next_n > 0)  # the next item's first block streams in while this one's last is computed
  def _():
    _start_block(refs, next_row, (slot0 + n) % 2, ppb, unroll)

  @pl.when(n > 0)
  def _():
    _wait_block(refs, (slot0 + n - 1) % 2)
    update(n - 1, last=True)

  slot_ref[0] = (slot0 + n) % 2
  for h in range(k_buf.shape[1]):
    out, lse = finish(m_sc[h, :, :1], l_sc[h, :, :1], acc_sc[h])
    o_ref[h] = out.astype(o_ref.dtype)
    lse_ref[h] = jnp.broadcast_to(lse, lse_ref.shape[1:])


def splits(cfg: PagedConfig, q, k_pages, v_pages, lengths, page_indices):
  """q [B, Hkv, G, D]; page_indices [B, splits * blocks_per_split * ppb] -> (o, lse) per split."""
  b, hkv, g, d = q.shape
  page_size = k_pages.shape[2]
  ppb, splits = cfg.blocks.pages_per_block, cfg.blocks.num_splits
  bps = page_indices.shape[1] // (ppb * splits)
  pltpu = backend._tpu_module()
  pool = pl.BlockSpec(memory_space=pl.ANY)  # the pools stay in HBM: the kernel DMAs their pages
  cores = 2 if b % 2 == 0 else 1  # a parallel core axis (megacore's two TensorCores), then in order
  per_core = b // cores

  def item(c, t):  # core c's step t works on (sequence, split) item t - 1; step 0 is a prologue
    w = jnp.maximum(t - 1, 0)  # lax.div / rem: no floor fix-up (no Mosaic scalar lowering for it)
    return c * per_core + lax.div(w, splits), lax.rem(w, splits)

  def q_map(c, t, *_):
    return item(c, t)[0], 0, 0, 0

  def out_map(c, t, *_):
    bi, s = item(c, t)
    return s, bi, 0, 0, 0

  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(cores, per_core * splits + 1),
    in_specs=[pl.BlockSpec((None, hkv, g, d), q_map), pool, pool],
    out_specs=[
      pl.BlockSpec((None, None, hkv, g, d), out_map),
      pl.BlockSpec((None, None, hkv, g, LANES), out_map),
    ],
    scratch_shapes=[
      backend.scratch_vmem((2, hkv, ppb, page_size, d), k_pages.dtype),
      backend.scratch_vmem((2, hkv, ppb, page_size, d), v_pages.dtype),
      pltpu.SemaphoreType.DMA((2, 2)),
      pltpu.SMEM((1,), jnp.int32),  # the slot of the current step's first block
      backend.scratch_vmem((hkv, g, LANES), jnp.float32),
      backend.scratch_vmem((hkv, g, LANES), jnp.float32),
      backend.scratch_vmem((hkv, g, d), jnp.float32),
    ],
  )
  kernel = functools.partial(
    _tiled_kernel, ppb=ppb, bps=bps, splits=splits, per_core=per_core, scale=cfg.scale,
    unroll=1 if cfg.target.interpret else DMA_UNROLL,  # the interpreter: less to trace
  )  # fmt: skip
  o, lse = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=[
      jax.ShapeDtypeStruct((splits, b, hkv, g, d), jnp.float32),
      jax.ShapeDtypeStruct((splits, b, hkv, g, LANES), jnp.float32),
    ],
    # The DMAs' addresses are in bounds by construction: the wrapper clamps lengths to the capacity
    # and maps every page id a length reaches into [0, P) (paged_attention's _checked_table).
    compiler_params=backend.compiler_params(
      cfg.target,
      dimension_semantics=("parallel", "arbitrary"),  # in order on a core: the next item prefetched
      disable_bounds_checks=True,
    ),
    interpret=cfg.target.interpret,
    name="paged_attention_tiled",
  )(lengths, page_indices.reshape(-1), q, k_pages, v_pages)
  return o, lse[..., 0]
