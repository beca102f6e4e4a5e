"""Mosaic GPU kernels for the fused LM-head loss (``impl="mosaic_gpu"``): Hopper wgmma + TMA.

Two kernels over flat tokens (h [Np, H], w [H, Vp] one vocabulary shard, both padded to tile
multiples by the wrapper; ids [Np] shard-local), each CTA one warpgroup, token rows the fastest
(last) grid axis:

  stats    grid (splits, Np / block_n). A CTA owns block_n rows and one of ``splits`` contiguous
           ranges of vocabulary tiles. For each [block_n, block_v] logits tile it streams h and w
           tiles of block_h hidden columns through a ``stages``-deep TMA ring (``emit_pipeline``)
           into wgmma, accumulating in f32 registers; the tile folds into the rows' online max /
           sum-exp / E[z] / chosen logit and is dropped. The splits' partial statistics are combined
           in XLA exactly as vocabulary shards are (log-sum-exp of log-sum-exps).
  dlogits  grid (vocab_chunk / block_v, Np / block_n) for one chunk of vocabulary columns: the same
           tile recomputed on chip, dl = g * (onehot(id) - exp(z - lse)) from the global lse, written
           (input dtype) by TMA into a [Np, vocab_chunk] buffer. XLA GEMMs then give the chunk's
           final dw[:, chunk] = h^T dl and add dl w_chunk^T to an f32 dh.
  stored   (training path, ``blocks.stored_cols`` > 0): the statistics kernel also TMA-stores, for
           its tiles of the first stored_cols columns, exp(z - m) (input dtype, m the row max after
           the tile's fold) and m; their dl = g (onehot - exp(z - m) e^(m - lse)) is one XLA
           elementwise pass, so those columns' logits are formed once for forward and backward, and
           the dlogits chunks start after them.

The backward at the H100's limit (registers 256 KiB / SM, shared memory 227 KiB, wgmma M >= 64; the
arithmetic and modelled times are :func:`kernels.fused_linear.mosaic_gpu_evidence.backward_options`):
dh needs a [64, H] f32 accumulator per CTA and dw an [H, block_v] one: 512 KiB each at H = 2048,
more than an SM holds, so neither GEMM can finish on chip without either (b) slicing H in the grid
(each H-slice recomputes the logits: 22 N·H·V flops at 256-column slices) or (c) reduce-adding
f32 partials to HBM with TMA (``copy_smem_to_gmem(reduction_op="add")``: N·V·H·8 / 128 = 318 GB at
N = 16384 with 128 x 128 tiles, ~2.3x slower than (a); the Mosaic GPU interpreter of jax 0.10 and
0.11 raises NotImplementedError on it, so it could not be verified here). (a), built: dl per
vocabulary chunk in HBM + XLA GEMMs, 8 N·H·V, is the least work that never stores logits; its best
case (every byte hidden, 798 TF/s) credits 598 TF/s on 6 N·H·V. (d) overlapping a chunk's GEMMs
with the next dlogits kernel gains nothing in that model (both compute-bound; XLA issues them on one
stream). Sharing the forward's pass with the backward's recompute needs per-logit state: all of it
(e: bf16 exp tiles per token chunk, 6 N·H·V) costs an f32 [H, V] dw accumulated per token chunk and
beats (a) only above the 5 % temp target; the first columns of it (the ``stored`` path above) fit
the target: 7.82 N·H·V at N = 16384 (13824 columns), 609 TF/s best case, 441 at 622 TF/s with no
overlap. So none of these options reaches the issue's 600 TF/s within the temp target except at the
top of the measured ceiling with every byte hidden (modelled; nothing here was timed). bf16 / f16 only: wgmma on f32 operands is tf32, which would
not meet the f32 tolerance.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend, support
from kernels.backend import Target
from kernels.fused_linear.mosaic_gpu_blocks import (
  MosaicLinearBlocks,
  default_blocks,
)
from kernels.lse import NEG_BIG, online_step, row_reductions


@dataclasses.dataclass(frozen=True)
class MosaicLinearConfig:
  target: Target
  blocks: MosaicLinearBlocks
  vocab: int  # columns of this shard; columns at or past it are padding
  temperature: float


# -------------------------------------------------------------------------------------------- kernels
def _logits_tile(h_rows, w_gmem, col0, acc_ref, cfg: MosaicLinearConfig):
  """acc_ref += h_rows [bn, H] @ w_gmem[:, col0 : col0 + bv], streamed over block_h columns of H
  through the TMA ring; returns the f32 [bn, bv] tile (WGMMA register layout)."""
  plgpu = backend.mosaic_gpu_module()
  bn, bv, bh = cfg.blocks.block_n, cfg.blocks.block_v, cfg.blocks.block_h
  tiles = backend.smem_transforms(w_gmem.dtype, cfg.target)

  def step(_, h_smem, w_smem):
    plgpu.wgmma(acc_ref, h_smem, w_smem)
    # delay_release=1: a slot is refilled one step after its body returns, so only the previous
    # step's wgmma must be done (it has read its slot) and this one overlaps the next TMA wait
    plgpu.wgmma_wait(1)

  plgpu.emit_pipeline(
    step,
    grid=(w_gmem.shape[0] // bh,),
    in_specs=[
      plgpu.BlockSpec((bn, bh), lambda k: (0, k), transforms=tiles, delay_release=1),
      plgpu.BlockSpec((bh, bv), lambda k: (k, 0), transforms=tiles, delay_release=1),
    ],
    max_concurrent_steps=cfg.blocks.stages,
  )(h_rows, w_gmem.at[:, pl.ds(col0, bv)])
  return acc_ref[...]


def _scaled_tile(h_rows, w_gmem, col0, cfg: MosaicLinearConfig):
  """(z [bn, bv] f32 = logits / temperature, col [bn, bv] int32), both in the WGMMA layout."""
  plgpu = backend.mosaic_gpu_module()
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  tile = functools.partial(_logits_tile, h_rows, w_gmem, col0, cfg=cfg)
  z = pl.run_scoped(tile, plgpu.ACC((bn, bv), jnp.float32)) * (1.0 / cfg.temperature)
  iota = lax.broadcasted_iota(jnp.int32, (bn, bv), 1)
  return z, col0 + backend.layout_cast(iota, plgpu.Layout.WGMMA, cfg.target)


def _store_exp(tile, p, m, rows, stored_refs, *, cfg):
  """Tile ``tile``'s exp(z - m) [bn, bv] (input dtype) and running row max m [bn] into pt [Np, cols]
  and mt [tiles, Np] when it is one of the stored tiles (the training path's first columns)."""
  plgpu = backend.mosaic_gpu_module()
  pt_gmem, mt_gmem, pt_s, mt_s = stored_refs
  bv = cfg.blocks.block_v

  @pl.when(tile < pt_gmem.shape[1] // bv)
  def _():
    plgpu.wait_smem_to_gmem(0)  # the previous stored tile's copies have read pt_s / mt_s
    pt_s[...] = p.astype(pt_s.dtype)
    mt_s[...] = m
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(pt_s, pt_gmem.at[rows, pl.ds(pl.multiple_of(tile * bv, bv), bv)])
    plgpu.copy_smem_to_gmem(mt_s, mt_gmem.at[tile, rows])


def _stats_kernel(h_gmem, w_gmem, ids_gmem, *refs, cfg, per_split, stored: bool, gapped: bool):
  """One (row block, vocabulary split): partial (lse, chosen, found, E[z]) into out_gmem [4, S, Np];
  with ``stored``, also exp(z - m) and m of the stored tiles (:func:`_store_exp`); with ``gapped``
  (a thr_gmem [Np] input and its thr_s scratch last), z is -inf outside each row's support."""
  thr_gmem, thr_s = (refs[0], refs[-1]) if gapped else (None, None)
  refs = refs[1:-1] if gapped else refs
  if stored:
    out_gmem, pt_gmem, mt_gmem, ids_s, out_s, bar, pt_s, mt_s = refs
    stored_refs = (pt_gmem, mt_gmem, pt_s, mt_s)
  else:
    out_gmem, ids_s, out_s, bar = refs
  plgpu = backend.mosaic_gpu_module()
  wg = plgpu.Layout.WGMMA
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  r, s = lax.axis_index("rows"), lax.axis_index("split")
  rows = pl.ds(r * bn, bn)
  plgpu.copy_gmem_to_smem(ids_gmem.at[rows], ids_s, bar)
  if gapped:
    plgpu.copy_gmem_to_smem(thr_gmem.at[rows], thr_s, bar)
  plgpu.barrier_wait(bar)
  bcast = lambda a: lax.broadcast_in_dim(a, (bn, bv), [0])
  ids = bcast(cast(ids_s[...], wg.reduce(1)))
  thr = bcast(cast(thr_s[...], wg.reduce(1))) if gapped else None
  first = s * per_split
  count = jnp.minimum(per_split, w_gmem.shape[1] // bv - first)

  def body(t, carry):
    m, l, acc_s, chosen, found = carry  # [bn] each
    z, col = _scaled_tile(h_gmem.at[rows], w_gmem, (first + t) * bv, cfg)
    valid = col < cfg.vocab
    z = jnp.where(valid, z, -jnp.inf)
    if gapped:  # -inf outside S (an id is < V: y's column is valid)
      z = support.gapped(z, thr, col == ids)
    m_new, l, acc_s, p = online_step(z, valid, m, l, acc_s, **row_reductions(bcast))
    if stored:
      _store_exp(first + t, p, m_new, rows, stored_refs, cfg=cfg)
    hit = (col == ids) & valid
    chosen = chosen + jnp.where(hit, z, 0.0).sum(axis=1)
    found = found + hit.astype(jnp.float32).sum(axis=1)
    return m_new, l, acc_s, chosen, found

  row_vec = lambda value: cast(jnp.full((bn,), value, jnp.float32), wg.reduce(1))
  init = (row_vec(NEG_BIG), row_vec(0.0), row_vec(0.0), row_vec(0.0), row_vec(0.0))
  m, l, acc_s, chosen, found = lax.fori_loop(0, count, body, init)
  lse = m + jnp.log(l)
  for k, val in enumerate((lse, chosen, found, m + acc_s / l)):  # E[z]: acc_s sums p * (z - m)
    out_s.at[k][...] = val
  plgpu.commit_smem()
  for k in range(4):
    plgpu.copy_smem_to_gmem(out_s.at[k], out_gmem.at[k, s, rows])
  plgpu.wait_smem_to_gmem(0)


def _dlogits_kernel(h_gmem, w_gmem, ids_gmem, lse_gmem, g_gmem, c0_gmem, *refs, cfg, gapped: bool):
  """One [bn, bv] tile of dl = g * (onehot(id) - softmax(z)) for columns c0 + [j * bv, (j + 1) bv);
  with ``gapped``, refs start with thr_gmem [Np] (and row_s ends with its scratch): z is -inf
  outside each row's support, so p = 0 there."""
  thr_gmem, refs = (refs[0], refs[1:]) if gapped else (None, refs)
  dl_gmem, row_s, dl_s, bar = refs
  plgpu = backend.mosaic_gpu_module()
  wg = plgpu.Layout.WGMMA
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  r, j = lax.axis_index("rows"), lax.axis_index("cols")
  rows = pl.ds(r * bn, bn)
  sources = (ids_gmem, lse_gmem, g_gmem) + ((thr_gmem,) if gapped else ())
  for src, dst in zip(sources, row_s):
    plgpu.copy_gmem_to_smem(src.at[rows], dst, bar)
  plgpu.barrier_wait(bar)
  bcast = lambda a: lax.broadcast_in_dim(cast(a, wg.reduce(1)), (bn, bv), [0])
  ids, lse, g = bcast(row_s[0][...]), bcast(row_s[1][...]), bcast(row_s[2][...])
  col0 = pl.multiple_of(c0_gmem[0] + j * bv, bv)  # the wrapper's chunk starts are bv multiples
  z, col = _scaled_tile(h_gmem.at[rows], w_gmem, col0, cfg)
  if gapped:
    z = support.gapped(z, bcast(row_s[3][...]), col == ids)
  onehot = (col == ids).astype(jnp.float32)
  # g == 0 (masked / padded rows) or a padding column: exactly 0, whatever the logits
  d = jnp.where((g == 0) | (col >= cfg.vocab), 0.0, g * (onehot - jnp.exp(z - lse)))
  dl_s[...] = d.astype(dl_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(dl_s, dl_gmem.at[rows, pl.ds(j * bv, bv)])
  plgpu.wait_smem_to_gmem(0)


def _stats_call(cfg: MosaicLinearConfig, h, w, ids, stored_cols: int = 0, thr=None):
  """h [Np, H], w [H, Vp] (tile multiples), ids [Np] int32 -> partials [4, splits, Np] f32; with
  stored_cols, also (pt [Np, stored_cols] h's dtype, mt [stored_cols / bv, Np] f32); thr [Np] f32
  support thresholds or None."""
  plgpu = backend.mosaic_gpu_module()
  n, bn, bv = h.shape[0], cfg.blocks.block_n, cfg.blocks.block_v
  tiles = w.shape[1] // bv
  per_split = -(-tiles // cfg.blocks.splits)
  splits = -(-tiles // per_split)  # every split owns at least one tile
  out_type = jax.ShapeDtypeStruct((4, splits, n), jnp.float32)
  gapped = thr is not None
  scratch = (
    plgpu.SMEM((bn,), jnp.int32),
    plgpu.SMEM((4, bn), jnp.float32),
    plgpu.Barrier(num_arrivals=1 + gapped),
  )
  if stored_cols:
    out_type = (
      out_type,
      jax.ShapeDtypeStruct((n, stored_cols), h.dtype),
      jax.ShapeDtypeStruct((stored_cols // bv, n), jnp.float32),
    )
    tile = backend.smem_transforms(h.dtype, cfg.target)
    scratch += (plgpu.SMEM((bn, bv), h.dtype, transforms=tile), plgpu.SMEM((bn,), jnp.float32))
  scratch += (plgpu.SMEM((bn,), jnp.float32),) * gapped  # the rows' thresholds
  kernel = functools.partial(
    _stats_kernel, cfg=cfg, per_split=per_split, stored=bool(stored_cols), gapped=gapped
  )
  return backend.mosaic_gpu_kernel(
    kernel,
    target=cfg.target,
    out_type=out_type,
    scratch_types=scratch,
    # rows last = blockIdx.x, the fastest-varying: the CTAs resident together share w tiles in L2
    grid=(splits, n // bn),
    grid_names=("split", "rows"),
  )(h, w, ids, *([thr] if gapped else []))


def _dlogits_call(cfg: MosaicLinearConfig, h, w, ids, lse, g, c0, width: int, thr=None):
  """dl [Np, width] (h's dtype) for vocabulary columns [c0, c0 + width); c0 [1] int32 (traced);
  thr [Np] f32 support thresholds or None."""
  plgpu = backend.mosaic_gpu_module()
  n = h.shape[0]
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  gapped = thr is not None
  rows = (plgpu.SMEM((bn,), jnp.int32),) + (plgpu.SMEM((bn,), jnp.float32),) * (2 + gapped)
  return backend.mosaic_gpu_kernel(
    functools.partial(_dlogits_kernel, cfg=cfg, gapped=gapped),
    target=cfg.target,
    out_type=jax.ShapeDtypeStruct((n, width), h.dtype),
    scratch_types=(
      rows,
      plgpu.SMEM((bn, bv), h.dtype, transforms=backend.smem_transforms(h.dtype, cfg.target)),
      plgpu.Barrier(num_arrivals=len(rows)),
    ),
    grid=(width // bv, n // bn),  # rows fastest, as in the statistics kernel
    grid_names=("cols", "rows"),
  )(h, w, ids, lse, g, c0, *([thr] if gapped else []))


# ------------------------------------------------------------------------------------------ wrappers
def _padded(cfg: MosaicLinearConfig, h, w, *rows):
  """h, w and per-row arrays zero-padded to tile multiples (a no-op at N = 8192 / 16384, V = 151936
  with 128-wide tiles). Padded rows have id 0 and g = 0; padded columns are masked in the kernels."""
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  pn, pv = -h.shape[0] % bn, -w.shape[1] % bv
  pad = lambda a, p: a if p == 0 else jnp.pad(a, [(0, p)] + [(0, 0)] * (a.ndim - 1))
  w = w if pv == 0 else jnp.pad(w, ((0, 0), (0, pv)))
  return pad(h, pn), w, *(pad(a, pn) for a in rows)


def combine_splits(partials):
  """[4, S, N] partial (lse, chosen, found, E[z]) of disjoint vocabulary ranges -> four [N]."""
  lse_s, chosen_s, found_s, ez_s = partials
  top = lse_s.max(axis=0)
  lse = top + jnp.log(jnp.exp(lse_s - top).sum(axis=0))
  return lse, chosen_s.sum(axis=0), found_s.sum(axis=0), (jnp.exp(lse_s - lse) * ez_s).sum(axis=0)


def stats(cfg: MosaicLinearConfig, h, w, ids, thr=None, *, store: bool = False):
  """Per-row (lse, chosen z, found, E[z]) of z = (h @ w) / temperature over this shard's columns, as
  :func:`kernels.fused_linear.pallas_tpu.stats`. h: [N, H]; w: [H, V]; ids: [N] int32. All f32 [N].

  store (the training path, blocks.stored_cols > 0): returns (stats, stored), stored = (pt
  [Np, cols], mt [cols / bv, Np]) for :func:`grads`: exp(z - m) of the first cols columns (0
  outside the support: a gapped call's stored tiles are of the gapped z). thr: [N] f32 support
  thresholds or None."""
  n = h.shape[0]
  hp, wp, idsp, *thrp = _padded(cfg, h, w, ids.astype(jnp.int32), *_opt(thr))
  cols = stored_columns(cfg, wp.shape[1]) if store else 0
  out = _stats_call(cfg, hp, wp, idsp, cols, *thrp)
  partials, stored = (out[0], out[1:]) if cols else (out, None)
  result = tuple(a[:n] for a in combine_splits(partials))
  return (result, stored) if store else result


def stored_columns(cfg: MosaicLinearConfig, vp: int) -> int:
  """Columns whose exp(z - m) the training path's statistics pass stores (block_v multiple, <= Vp)."""
  return min(cfg.blocks.stored_cols, vp)


def _stored_dl(cfg: MosaicLinearConfig, stored, ids, lse, g, dtype):
  """dl [Np, cols] = g * (onehot(id) - exp(z - m) exp(m - lse)) from the stored tiles (XLA, one
  elementwise pass); exactly 0 for g == 0 rows and padding columns, as the dlogits kernel."""
  pt, mt = stored  # [Np, cols], [cols / bv, Np]
  n, cols = pt.shape
  bv = cfg.blocks.block_v
  scale = jnp.exp(mt.T - lse[:, None])[:, :, None]  # [Np, tiles, 1]: m <= lse
  p = (pt.astype(jnp.float32).reshape(n, cols // bv, bv) * scale).reshape(n, cols)
  col = lax.broadcasted_iota(jnp.int32, (n, cols), 1)
  d = g[:, None] * ((col == ids[:, None]).astype(jnp.float32) - p)
  return jnp.where((g[:, None] == 0) | (col >= cfg.vocab), 0.0, d).astype(dtype)


def _opt(thr) -> tuple:
  return () if thr is None else (thr.astype(jnp.float32),)


def grads(cfg: MosaicLinearConfig, h, w, ids, lse, g, dh_dtype, dw_dtype, stored=None, thr=None):
  """(dh [N, H], dw [H, V]) of sum_n g[n] * (z[n, id_n] - lse[n]), z = (h @ w) / temperature, as
  :func:`kernels.fused_linear.pallas_tpu.grads` (g [N] f32 includes 1 / temperature).

  Vocabulary chunk by chunk: the dlogits kernel writes dl [Np, chunk] in h's dtype, then
  dw[:, chunk] = h^T dl (stored in dw_dtype) and dh += dl w[:, chunk]^T (f32 accumulator). With
  ``stored`` (:func:`stats`'s), the first columns' dl comes from the stored exp(z - m) instead of a
  recomputed logits tile, and the chunks start after them. ``thr``: [N] f32 support thresholds or
  None (the stored tiles already hold the gapped z's exp)."""
  n, hd = h.shape
  v = w.shape[1]
  hp, wp, idsp, lsep, gp, *thrp = _padded(cfg, h, w, ids.astype(jnp.int32), lse, g, *_opt(thr))
  vp = wp.shape[1]
  start = 0 if stored is None else stored[0].shape[1]  # columns whose dl comes from `stored`
  chunk = max(1, min(cfg.blocks.vocab_chunk, vp - start))
  full, tail = divmod(vp - start, chunk)

  def gemms(dl, c0, width: int, dh):  # dl [Np, width] for columns [c0, c0 + width)
    wc = lax.dynamic_slice_in_dim(wp, c0, width, axis=1)
    dh = dh + jnp.dot(dl, wc.T, preferred_element_type=jnp.float32)
    return dh, jnp.dot(hp.T, dl, preferred_element_type=jnp.float32).astype(dw_dtype)

  def one(c0: jax.Array, width: int, dh):
    return gemms(_dlogits_call(cfg, hp, wp, idsp, lsep, gp, c0.reshape(1), width, *thrp), c0, width, dh)  # fmt: skip

  def body(c, carry):
    dh, dw = carry
    c0 = (start + c * chunk).astype(jnp.int32)
    dh, dwc = one(c0, chunk, dh)
    return dh, lax.dynamic_update_slice_in_dim(dw, dwc, c0, axis=1)

  dh, dw = jnp.zeros(hp.shape, jnp.float32), jnp.zeros((hd, vp), dw_dtype)
  if start:
    dh, dwc = gemms(_stored_dl(cfg, stored, idsp, lsep, gp, hp.dtype), 0, start, dh)
    dw = lax.dynamic_update_slice_in_dim(dw, dwc, 0, axis=1)
  dh, dw = lax.fori_loop(0, full, body, (dh, dw))
  if tail:
    dh, dwc = one(jnp.int32(start + full * chunk), tail, dh)
    dw = lax.dynamic_update_slice_in_dim(dw, dwc, start + full * chunk, axis=1)
  return dh[:n].astype(dh_dtype), dw[:, :v]


def make_config(target: Target, blocks, n: int, h: int, v: int, dtype, temperature: float):
  """The validated config of one call (ValueError / TypeError before anything compiles)."""
  backend.check_mosaic_gpu_target(target)
  if blocks is None:
    blocks = default_blocks(n, h, v)
  if not isinstance(blocks, MosaicLinearBlocks):
    raise TypeError(f"blocks for impl='mosaic_gpu' must be MosaicLinearBlocks, got {type(blocks)}")
  blocks.check(h, dtype)
  return MosaicLinearConfig(target, blocks, v, temperature)
