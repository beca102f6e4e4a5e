"""Mosaic GPU paged decode attention (``impl="mosaic_gpu"``): GQA with split-K, for Hopper.

One CTA (one warpgroup) per (sequence b, kv head h, split s) computes the online softmax of the G query
heads that share kv head h over the split's pages, so each K/V page is read from HBM once per kv head:

* the split's page ids are staged once into shared memory by one bulk copy, so no page gather waits on
  a global-memory load of its id;
* the G query rows are padded to the 64-row wgmma tile once, in the wrapper, and sit in shared memory:
  the G heads of a kv head share every K / V tile on the tensor cores;
* K and V pages are gathered by TMA bulk copies (one per page, each with its own barrier) into a
  ``stages``-deep ring of [pages_per_block * page_size, D] shared-memory tiles: the copies of block
  j + stages - 1 are issued at the top of iteration j, so ``stages - 1`` blocks are in flight while
  block j is multiplied;
* scores q·kᵀ and p·v are warpgroup MMAs (wgmma) accumulating in f32 registers (p is staged through
  shared memory); the softmax statistics are WGMMA-layout row reductions;
* each split writes its normalised output (the G live rows only) and log-sum-exp;
  ``reference.combine_splits`` merges them.

Only the blocks holding tokens below ``lengths[b]`` are copied (the trip count comes from the length).
Inside the last block, tokens past the length are masked out of the scores, and their V rows are zeroed
in shared memory before p·v: a recycled page's stale NaN / inf would otherwise give 0 * NaN = NaN.
bf16 / f16 pages only: wgmma on f32 operands is tf32, which would not meet the f32 tolerance (use
impl="pallas" for f32 caches).

Launch account at the bench's production shapes with the default blocks (H100: 132 SMs, ~3.0 TB/s,
~1 us latency; :meth:`MosaicPagedBlocks.plan`, re-derived by a test):

* decode-4k (B 64, 16 q / 2 kv heads, D 128, page 16, ctx 4096, 64-token blocks, 4 stages, 1 split):
  128 programs on 132 SMs (97% of a wave), block 32 KiB x 4 stages, in flight 96 KiB/SM (Little:
  22 KiB), smem 185 KiB/CTA, busiest program 2.00 MiB, ideal 238.1 MB = 79 us at 3.0 TB/s, tail
  bound 89 us
* decode-16k-b8 (B 8, ctx 16384, 7 splits by the wave rule):
  112 programs on 132 SMs (85% of a wave), block 32 KiB x 4 stages, in flight 96 KiB/SM (Little:
  22 KiB), smem 185 KiB/CTA, busiest program 1.16 MiB, ideal 133.1 MB = 44 us at 3.0 TB/s, tail
  bound 45 us

Why that should reach the target: 128 programs fill one wave at 97 % with no split (FlashAttention-2's
rule), each keeping 3 x 32 KiB = 96 KiB of K / V requested while it computes: 4x the 22 KiB per SM that
Little's law asks at 3.0 TB/s x 1 us, above the 32-64 KiB of headroom. The floor is then the busiest
SM's bytes at its share of the bandwidth (the tail bound): 89 us at decode-4k, the ideal bytes at 89 %
of 3.0 TB/s (target <= 0.11 ms), 3.7x jax's 0.329 ms; 45 us at decode-16k-b8 (98 %, 4.6x jax's
0.208 ms). The previous defaults (2 stages of 128 tokens, 192 KiB of shared memory, split-K to 512
programs of one CTA per SM: ~3.9 waves; each page id read from global memory right before its gather)
measured 0.322 / 0.269 ms. Unmeasured (no GPU here): whether the per-block work (two wgmmas, the
softmax, p through shared memory) fits the ~1.4 us a 32 KiB block allows at 23 GB/s per SM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend
from kernels.backend import Target
from kernels.paged_attention.mosaic_gpu_blocks import (
  DTYPES,
  ROWS,
  MosaicPagedBlocks,
  MosaicPagedConfig,
  default_blocks,
  id_shape,
  pages_per_split,
)
from kernels.paged_attention.reference import combine_splits
from kernels.paged_attention.softmax import MASK


def _kernel(
  lengths_gmem,  # [B] int32
  pages_gmem,  # [B, splits, id_rows, id_cols] int32: each split's ids, then filler
  q_gmem,  # [B, Hkv, 64, D]
  k_gmem,  # [Hkv, P, page_size, D]
  v_gmem,
  o_gmem,  # [splits, B, Hkv, G8, D] f32 (G8: the live query rows, rounded up to 8)
  lse_gmem,  # [splits, B, Hkv, 64] f32
  ids_smem,  # [id_rows, id_cols] int32: this split's page ids
  q_smem,  # [64, D]
  k_smem,  # [stages, bk, D]
  v_smem,
  p_smem,  # [64, bk]
  o_smem,  # [64, D] f32
  lse_smem,  # [64] f32
  ids_bar,
  q_bar,
  k_bar,  # [stages * pages_per_block]: one per page of the ring
  v_bar,
  *,
  cfg: MosaicPagedConfig,
  pages_per_split: int,
):
  plgpu = backend.mosaic_gpu_module()
  b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
  ppb, stages = cfg.blocks.pages_per_block, cfg.blocks.stages
  page_size, d = k_gmem.shape[2], k_gmem.shape[3]
  bk = ppb * page_size
  id_cols = pages_gmem.shape[3]
  pps = pages_per_split
  length = lengths_gmem[b]
  split_start = s * pps * page_size
  trips = jnp.clip(lax.div(jnp.maximum(length - split_start, 0) + bk - 1, bk), 0, pps // ppb)

  def issue(j):  # TMA-gather block j's pages into ring slot j % stages; ids from shared memory
    slot = lax.rem(j, stages)
    for i in range(ppb):
      k = j * ppb + i
      page = ids_smem[lax.div(k, id_cols), lax.rem(k, id_cols)]
      rows = pl.ds(i * page_size, page_size)
      bar = slot * ppb + i
      plgpu.copy_gmem_to_smem(k_gmem.at[h, page], k_smem.at[slot, rows], k_bar.at[bar])
      plgpu.copy_gmem_to_smem(v_gmem.at[h, page], v_smem.at[slot, rows], v_bar.at[bar])

  plgpu.copy_gmem_to_smem(pages_gmem.at[b, s], ids_smem, ids_bar)
  plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, q_bar)
  plgpu.barrier_wait(ids_bar)
  for j in range(stages - 1):  # the prologue: blocks 0 .. stages - 2 in flight
    pl.when(j < trips)(functools.partial(issue, j))
  plgpu.barrier_wait(q_bar)
  refs = (q_smem, k_smem, v_smem, p_smem, k_bar, v_bar)

  def body(j, carry):
    # Slot (j - 1) % stages is free (block j - 1's wgmmas are done: their results are in registers):
    # refill it with block j + stages - 1 before waiting on block j.
    pl.when(j + stages - 1 < trips)(lambda: issue(j + stages - 1))
    return _block(cfg, refs, j, split_start + j * bk, length, carry)

  wg = plgpu.Layout.WGMMA
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  init = (
    cast(jnp.full((ROWS,), MASK, jnp.float32), wg.reduce(1)),
    cast(jnp.zeros((ROWS,), jnp.float32), wg.reduce(1)),
    cast(jnp.zeros((ROWS, d), jnp.float32), wg),
  )
  m, l, acc = lax.fori_loop(0, trips, body, init)
  seen = l > 0  # a split that saw no token: (0, -inf)
  safe_l = jnp.where(seen, l, 1.0)
  o_smem[...] = acc * lax.broadcast_in_dim(1.0 / safe_l, acc.shape, [0])
  lse_smem[...] = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, o_gmem.shape[3])], o_gmem.at[s, b, h])
  plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[s, b, h])
  plgpu.wait_smem_to_gmem(0)


def _block(cfg: MosaicPagedConfig, refs, j, start, length, carry):
  """One online-softmax step over ring slot j % stages, whose tokens start at ``start``."""
  plgpu = backend.mosaic_gpu_module()
  wg = plgpu.Layout.WGMMA
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  q_smem, k_smem, v_smem, p_smem, k_bar, v_bar = refs
  ppb, stages = cfg.blocks.pages_per_block, cfg.blocks.stages
  bk, d = k_smem.shape[1], k_smem.shape[2]
  m, l, acc = carry
  slot = lax.rem(j, stages)
  for i in range(ppb):
    plgpu.barrier_wait(k_bar.at[slot * ppb + i])

  def scores(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
    return acc_ref[...]

  if cfg.target.interpret and not backend.INTERPRETER_TRANSPOSED_WGMMA:
    # Interpreter gap (jax 0.10): wgmma with a transposed operand fails there, so it computes the
    # same product from the shared-memory tiles; jax 0.11's interpreter runs the wgmma itself.
    k_tile = k_smem.at[slot][...]
    qk = jnp.dot(q_smem[...], k_tile.T, preferred_element_type=jnp.float32)
  else:
    qk = pl.run_scoped(scores, plgpu.ACC((ROWS, bk), jnp.float32))
  qk = qk * cfg.scale
  pos = start + cast(lax.broadcasted_iota(jnp.int32, (ROWS, bk), 1), wg)
  qk = jnp.where(pos < length, qk, MASK)  # a select: stale NaN keys past the length vanish too
  m_new = jnp.maximum(m, qk.max(axis=1))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(qk - lax.broadcast_in_dim(m_new, qk.shape, [0]))
  l = alpha * l + p.sum(axis=1)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  for i in range(ppb):
    plgpu.barrier_wait(v_bar.at[slot * ppb + i])

  @pl.when(start + bk > length)
  def _zero_stale_values():
    # The last block: V rows past the length (a recycled page's stale NaN / inf, or the filler page)
    # would give p * v = 0 * NaN = NaN. Once per program, on one [bk, D] tile in shared memory.
    tile = v_smem.at[slot]
    rows = start + cast(lax.broadcasted_iota(jnp.int32, (bk, d), 0), wg)
    tile[...] = jnp.where(rows < length, tile[...], jnp.zeros((), tile.dtype))

  # p goes through shared memory: wgmma's A operand from registers is another interpreter gap, and
  # the 64 x bk tile is small next to the K / V tiles. commit_smem orders the stores (and the V
  # zeroing above) before the wgmma reads them.
  p_smem[...] = p.astype(p_smem.dtype)
  plgpu.commit_smem()

  def pv(acc_ref):  # a fresh accumulator (the interpreter has no run_state to seed one with acc)
    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
    return acc_ref[...]

  acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32))
  return m_new, l, acc


def _scratch(cfg: MosaicPagedConfig, bk: int, d: int, dtype, id_shape) -> tuple:
  """The CTA's shared memory, in _kernel's argument order (MosaicPagedBlocks.smem_bytes counts it)."""
  plgpu = backend.mosaic_gpu_module()
  stages, ppb = cfg.blocks.stages, cfg.blocks.pages_per_block
  tiles = backend.smem_transforms(dtype, cfg.target)
  return (
    plgpu.SMEM(tuple(id_shape), jnp.int32),
    plgpu.SMEM((ROWS, d), dtype, transforms=tiles),
    plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
    plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
    plgpu.SMEM((ROWS, bk), dtype, transforms=tiles),
    plgpu.SMEM((ROWS, d), jnp.float32, transforms=backend.smem_transforms(jnp.float32, cfg.target)),
    plgpu.SMEM((ROWS,), jnp.float32),
    plgpu.Barrier(num_arrivals=1),
    plgpu.Barrier(num_arrivals=1),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages * ppb),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages * ppb),
  )


def _splits(cfg: MosaicPagedConfig, q, k_pages, v_pages, lengths, page_indices, live_rows, pps):
  """q [B, Hkv, 64, D]; page_indices [B, splits, id_rows, id_cols] -> (o, lse) per split."""
  b, hkv, _, d = q.shape
  page_size = k_pages.shape[2]
  splits = cfg.blocks.num_splits
  bk = cfg.blocks.pages_per_block * page_size
  dtype = k_pages.dtype
  return backend.mosaic_gpu_kernel(
    functools.partial(_kernel, cfg=cfg, pages_per_split=pps),
    target=cfg.target,
    out_type=(
      jax.ShapeDtypeStruct((splits, b, hkv, live_rows, d), jnp.float32),
      jax.ShapeDtypeStruct((splits, b, hkv, ROWS), jnp.float32),
    ),
    scratch_types=_scratch(cfg, bk, d, dtype, page_indices.shape[2:]),
    grid=(b, hkv, splits),
    grid_names=("b", "h", "s"),
  )(lengths, page_indices, q, k_pages, v_pages)


def paged_attention(
  q,  # [B, Hq, D]
  k_pages,  # [Hkv, P, page_size, D]
  v_pages,  # [Hkv, P, page_size, D]
  lengths,  # [B] int32, already clipped to pages_per_seq * page_size
  page_indices,  # [B, pages_per_seq] int32
  *,
  scale: float,
  target: Target,
  blocks: MosaicPagedBlocks | None,
):  # -> [B, Hq, D] in q's dtype
  """The body of ``kernels.paged_attention(..., impl="mosaic_gpu")`` after its validation."""
  backend.check_mosaic_gpu_target(target)
  b, hq, d = q.shape
  hkv, _, page_size, _ = k_pages.shape
  if jnp.dtype(k_pages.dtype).name not in DTYPES:
    raise ValueError(
      f"impl='mosaic_gpu' needs {DTYPES} pages (wgmma on f32 is tf32), got {k_pages.dtype}"
    )
  if d % 64 or d > 256:
    raise ValueError(f"the Mosaic GPU kernel needs head_dim a multiple of 64, <= 256; got {d}")
  g = hq // hkv
  if g > ROWS:
    raise ValueError(
      f"the Mosaic GPU kernel handles at most {ROWS} query heads per kv head, got {g}"
    )
  pages_per_seq = page_indices.shape[1]
  if blocks is None:
    blocks = default_blocks(b, hkv, pages_per_seq, page_size, d, k_pages.dtype)
  if not isinstance(blocks, MosaicPagedBlocks):
    raise TypeError(f"blocks for impl='mosaic_gpu' must be MosaicPagedBlocks, got {type(blocks)}")
  blocks.check(page_size, d, k_pages.dtype, pages_per_seq)
  return _call(MosaicPagedConfig(target, blocks, scale), q, k_pages, v_pages, lengths, page_indices)


@functools.partial(jax.jit, static_argnums=0)
def _call(cfg: MosaicPagedConfig, q, k_pages, v_pages, lengths, page_indices):
  b, hq, d = q.shape
  hkv = k_pages.shape[0]
  g = hq // hkv
  qg = q.reshape(b, hkv, g, d).astype(k_pages.dtype)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))  # zero rows: sliced off below
  splits = cfg.blocks.num_splits
  pps = pages_per_split(page_indices.shape[1], cfg.blocks)
  rows, cols = id_shape(pps)
  pad = splits * pps - page_indices.shape[1]
  page_indices = jnp.pad(page_indices, ((0, 0), (0, pad)))  # filler page 0: beyond every length
  ids = jnp.pad(page_indices.reshape(b, splits, pps), ((0, 0), (0, 0), (0, rows * cols - pps)))
  ids = ids.reshape(b, splits, rows, cols)
  live_rows = -(-g // 8) * 8  # whole 8-row tiles of the swizzled output tile
  o, lse = _splits(cfg, qg, k_pages, v_pages, lengths.astype(jnp.int32), ids, live_rows, pps)
  out = o[0] if splits == 1 else combine_splits(o, lse[..., :live_rows])
  return out[:, :, :g].reshape(b, hq, d).astype(q.dtype)
