"""Fused Pallas kernels for the LM-head GRPO loss: logits live only as VMEM tiles, never in HBM.

Over flat tokens (h [N, H], w [H, V] one vocabulary shard, ids [N] shard-local):

  stats   grid (N/bn, V/bv, H/bh): each f32 logits tile folds into per-lane online statistics (every
          one of a row's 128 lanes its own max / sum-exp / E[z] / chosen-logit stream, elementwise
          over the tile's 128-column slabs, a row group at a time so a group stays in vregs);
          the lanes merge per row in XLA. With block_h = H each step folds the previous step's
          tile from VMEM while the MXU computes its own (one more vocabulary step per row block).
  grads   the one gradient kernel of :mod:`.pallas_tpu_grads` (each logits tile recomputed once for
          dh and dw: 8 N·H·V flops with the statistics) where a device is one TensorCore and dh's
          rows fit VMEM; else the two kernels here:
  dhidden grid (N/bn, V/bv):       recomputes each logits tile, dl = g * (onehot - softmax) from the
          (global) log-sum-exp, and accumulates dl @ w^T into a [bn, H] f32 VMEM accumulator.
  dweight grid (V/bv, N/bn):       the same tile recomputed, accumulating h^T @ dl into [H, bv]
          (its vocabulary axis parallel: the two cores of a megacore chip, v4 / v5p).

Recomputing instead of storing logits is the price of O(tile) memory (10 N·H·V flops on the
two-kernel path, 8 on the one-kernel path, against 6 for a path that stores logits).
This is the tiled family (TPU Mosaic, CPU interpreter); a GPU program cannot accumulate across a grid
axis, and Triton cannot hold the [bn, H] / [H, bv] accumulators in registers, so GPU runs `chunked`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend, support
from kernels.backend import Target
from kernels.fused_linear.pallas_blocks import LinearBlocks, kernel_vmem_bytes
from kernels.lse import NEG_BIG, merge, online_step
from kernels.tpu_vmem import vmem_limit

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class FusedConfig:
  target: Target
  blocks: LinearBlocks
  vocab: int  # columns of this shard
  temperature: float


def _params(cfg: FusedConfig, h, kernel: str, semantics):
  """Compiler params of one kernel: its grid semantics and, where its step outgrows the scoped VMEM
  default, the generation's VMEM as the limit (:func:`kernels.tpu_vmem.vmem_limit`)."""
  need = kernel_vmem_bytes(cfg.blocks, h.shape[1], h.dtype.itemsize)[kernel]
  limit = vmem_limit(cfg.target, need)
  return backend.compiler_params(cfg.target, dimension_semantics=semantics, vmem_limit_bytes=limit)


def _cols(j, shape, cfg):
  col = j * cfg.blocks.block_v + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return col, col < cfg.vocab


LANES = 128


def lane_width(block_v: int) -> int:
  """Lanes of the per-lane statistics: 128, or the whole block where it is no multiple of 128 (a
  block_v equal to a small V)."""
  return LANES if block_v % LANES == 0 else block_v


STACK_VREGS = 16  # f32 vregs of a row group's slab stack: the group's slabs stay in registers


def row_group(slabs: int, interpret: bool) -> int:
  """Rows the statistics fold at a time: 16, or on TPU 8 where 16 rows of ``slabs`` 128-column slabs
  would stack more than STACK_VREGS vregs (a 1536-wide tile's 12 slabs; the interpreter keeps 16:
  fewer unrolled groups to trace). Compiled for v6e at qwen2.5-3b-8k, the statistics kernel alone:
  512 x 1536 folds 8 rows at 6.80 ms (16: 6.90, 4: 9.60); 512 x 512 folds 16 at 7.09 (8: 7.09,
  32: 7.08); v7x's 512 x 512 and v5e's 512 x 768 are slower at 8 (4.48 / 20.98 ms against 4.11 /
  20.45)."""
  return 16 if interpret or slabs * 16 // 8 <= STACK_VREGS else 8


def _stats_kernel(*refs, cfg: FusedConfig, gapped: bool, lagged: bool):
  """Per-lane online statistics: each of the 128 lanes of a row is its own log-sum-exp stream over
  the vocabulary columns that land on it (column j*bv + k*128 + lane), folded slab by slab with
  elementwise max / add only; the lanes merge once, outside (:func:`stats`). The statistics are the
  resident output blocks themselves, started by a select at the first fold (no branch the schedule
  issues each step), and the fold runs over row groups (:func:`row_group`) whose tiles stay in registers.

  ``lagged`` (block_h = H): step j folds the previous step's tile, kept in VMEM scratch, and then
  stores its own: the fold depends on nothing the step's matmul produces, so the static schedule
  issues its vector work in the bundles where the MXU results drain (the fold after the matmul, in
  one step, was a third of the step's bundles). The grid has one more vocabulary step than blocks:
  step 0 folds nothing real (its statistics are dropped by the next step's start select), the last
  step recomputes the last block's product (1 / (V / bv + 1) more MXU work) and folds the last tile.
  refs: h, w, ids, [thr (gapped)], m, l, s, c, [acc (block_h < H) | tile (lagged)]."""
  h_ref, w_ref, ids_ref = refs[:3]
  thr_ref = refs[3] if gapped else None
  m_ref, l_ref, s_ref, c_ref, *acc = refs[3 + gapped :]
  j, k = pl.program_id(1), pl.program_id(2)
  stat_refs = (m_ref, l_ref, s_ref, c_ref)
  if lagged:
    (tile,) = acc
    _fold(tile, ids_ref, stat_refs, j - 1, cfg, thr_ref, first=j == 1)
    tile[...] = jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    return
  part = jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32)
  if acc:  # block_h < H: accumulate over k, fold at the last k
    (acc,) = acc
    acc[...] = jnp.where(k == 0, 0.0, acc[...]) + part
    pl.when(k == pl.num_programs(2) - 1)(lambda: _fold(acc, ids_ref, stat_refs, j, cfg, thr_ref))  # fmt: skip
  else:
    _fold(part, ids_ref, stat_refs, j, cfg, thr_ref)


def _fold(z_tile, ids_ref, stat_refs, j, cfg: FusedConfig, thr_ref=None, first=None):
  """Fold the [bn, bv] f32 logits tile of vocabulary block ``j`` (a value, or a VMEM ref read a row
  group at a time) into the per-lane statistics (m, l, s, c) [bn, 128]; ``thr_ref`` [bn, 1]: the
  rows' support thresholds (gapped calls), applied to each scaled slab; ``first``: the statistics
  start here (default: block 0)."""
  bn, bv = z_tile.shape
  width = lane_width(bv)
  slabs = bv // width
  tail = cfg.vocab % bv  # columns of the last vocabulary block; 0: every block is whole
  first = j == 0 if first is None else first
  group = row_group(slabs, cfg.target.interpret)
  for r in range(0, bn, group):
    rows = slice(r, min(bn, r + group))
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows.stop - r, width), 1)
    idrel = ids_ref[rows, :] - j * bv  # [rg, 1]: the id's column within this block
    thr = None if thr_ref is None else thr_ref[rows, :]  # [rg, 1]
    zs, hits = [], []
    for kk in range(slabs):
      z = z_tile[rows, kk * width : (kk + 1) * width]
      hit = lane == idrel - kk * width  # the id's column: one lane-compare with a [rg, 1] operand
      if cfg.temperature != 1.0:
        z = z * (1.0 / cfg.temperature)
      if thr is not None:  # -inf outside S: the online step's LOG_FLOOR makes them exact zeros
        z = support.gapped(z, thr, hit)
      if tail and (kk + 1) * width > tail:  # may hold columns past V (in the last block only)
        z = jnp.where(lane < cfg.vocab - j * bv - kk * width, z, -jnp.inf)
      zs.append(z)
      hits.append(hit)
    m_old, l_old, s_old, c_old = (
      jnp.where(first, init, ref[rows, :]) for ref, init in zip(stat_refs, (NEG_BIG, 0.0, 0.0, 0.0))
    )
    stack = jnp.stack(zs)  # [slabs, rg, 128]
    m, l, s, _ = online_step(
      stack, None, m_old, l_old, s_old,
      rmax=lambda x: jnp.max(x, axis=0), rsum=lambda x: jnp.sum(x, axis=0),
      expand=lambda x: x[None],
    )  # fmt: skip
    # a lane's stream meets the id's column at most once over the whole vocabulary (ids outside
    # [0, V) are -1: never), so a select keeps it (no add)
    c = c_old
    for z, hit in zip(zs, hits):
      c = jnp.where(hit, z, c)
    for ref, val in zip(stat_refs, (m, l, s, c)):
      ref[rows, :] = val


def stats(cfg: FusedConfig, h, w, ids, thr=None):
  """Per-row (lse, chosen z, found, E[z]) of z = (h @ w) / temperature over this shard's columns.

  h: [N, H]; w: [H, V]; ids: [N] int32 shard-local (outside [0, V): not in this shard); thr: [N]
  f32 support thresholds (:mod:`.gap`: z outside each row's sampled support is -inf) or None (the
  kernel compiles without them). All f32 [N].
  """
  n, hd = h.shape
  v = w.shape[1]
  bn, bv, bh = cfg.blocks.block_n, cfg.blocks.block_v, cfg.blocks.block_h
  width = lane_width(bv)
  lanes = pl.BlockSpec((bn, width), lambda i, j, k: (i, 0))
  nk = hd // bh
  nv = pl.cdiv(v, bv)
  lagged = nk == 1  # the fold one step behind the matmul (:func:`_stats_kernel`)
  # an id outside [0, V) matches no column (-1: not even a masked one past V in the last block)
  found = ((ids >= 0) & (ids < v)).astype(jnp.float32)
  row = pl.BlockSpec((bn, 1), lambda i, j, k: (i, 0))
  gapped = thr is not None
  m, l, s, c = pl.pallas_call(
    functools.partial(_stats_kernel, cfg=cfg, gapped=gapped, lagged=lagged),
    grid=(pl.cdiv(n, bn), nv + lagged, nk),
    in_specs=[
      pl.BlockSpec((bn, bh), lambda i, j, k: (i, k)),
      # lagged: the extra last step maps to the last block again (no new DMA)
      pl.BlockSpec((bh, bv), lambda i, j, k: (k, jnp.minimum(j, nv - 1))),
      row,
    ]
    + [row] * gapped,
    out_specs=[lanes] * 4,
    out_shape=[jax.ShapeDtypeStruct((n, width), jnp.float32)] * 4,
    scratch_shapes=[backend.scratch_vmem((bn, bv), jnp.float32)],  # the k-sum or the lagged tile
    compiler_params=_params(cfg, h, "stats", ("parallel", "arbitrary", "arbitrary")),
    interpret=cfg.target.interpret,
    name="fused_linear_grpo_stats",
  )(h, w, jnp.where(found > 0, ids, -1).reshape(n, 1), *_rows(n, thr))
  # the lanes' streams merged per row ([N, 128] -> [N]: XLA, once per call)
  top, l_all, s_all = merge(m, l, s, axis=1)
  return (
    top[:, 0] + jnp.log(l_all[:, 0]),
    jnp.sum(c, axis=1),
    found,
    top[:, 0] + s_all[:, 0] / l_all[:, 0],
  )


def _rows(n: int, thr) -> list:
  """The optional thresholds as a kernel's [N, 1] input: [] when not gapped."""
  return [] if thr is None else [thr.astype(jnp.float32).reshape(n, 1)]


def _dlogits(h, w, ids, lse, g, col, valid, cfg, thr=None):
  """dl = g * (onehot(id) - softmax(z)) for one recomputed tile; zero outside the vocabulary and,
  with thresholds ``thr`` [bn, 1], outside each row's sampled support (p = exp(-inf) = 0 there)."""
  z = jnp.dot(h, w, preferred_element_type=jnp.float32) * (1.0 / cfg.temperature)
  if thr is not None:
    z = support.gapped(z, thr, col == ids)
  p = jnp.exp(z - lse)
  return jnp.where(valid, g * ((col == ids).astype(jnp.float32) - p), 0.0)


def _zero_tail_columns(w_ref, j, cfg: FusedConfig, axis: int = 1):
  """Zero the weight tile's columns past V in the last vocabulary step: its DMA left garbage there
  (maybe NaN, and 0 * NaN is NaN in dl @ w^T). A store into the input window, in the tail step only;
  a select over the whole [H, bv] tile with an iota mask is a relayout Mosaic rejects
  (``vector<HxBVxi1>``), and would cost a pass over the tile at every step."""
  bv = cfg.blocks.block_v
  tail = cfg.vocab % bv
  if tail == 0:
    return

  @pl.when(j == pl.num_programs(axis) - 1)  # axis: the grid's vocabulary axis
  def _zero():
    w_ref[:, tail:] = jnp.zeros((w_ref.shape[0], bv - tail), w_ref.dtype)


def _dh_kernel(*refs, cfg: FusedConfig, gapped: bool):
  h_ref, w_ref, ids_ref, lse_ref, g_ref = refs[:5]
  thr = refs[5][...] if gapped else None
  dh_ref, acc = refs[5 + gapped :]
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    acc[...] = jnp.zeros_like(acc)

  _zero_tail_columns(w_ref, j, cfg)
  h, w = h_ref[...], w_ref[...]
  col, valid = _cols(j, (h.shape[0], cfg.blocks.block_v), cfg)
  dl = _dlogits(h, w, ids_ref[...], lse_ref[...], g_ref[...], col, valid, cfg, thr)
  acc[...] += jax.lax.dot_general(dl.astype(w.dtype), w, _NT, preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _store():
    dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _dw_kernel(*refs, cfg: FusedConfig, n: int, gapped: bool):
  h_ref, w_ref, ids_ref, lse_ref, g_ref = refs[:5]
  thr = refs[5][...] if gapped else None
  dw_ref, acc = refs[5 + gapped :]
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    acc[...] = jnp.zeros_like(acc)

  bn = cfg.blocks.block_n
  rows = i * bn + jax.lax.broadcasted_iota(jnp.int32, (bn, 1), 0)
  h = jnp.where(rows < n, h_ref[...], 0)  # the tail tile's rows past N hold garbage
  col, valid = _cols(j, (bn, cfg.blocks.block_v), cfg)
  dl = _dlogits(h, w_ref[...], ids_ref[...], lse_ref[...], g_ref[...], col, valid & (rows < n), cfg, thr)  # fmt: skip
  acc[...] += jax.lax.dot_general(h, dl.astype(h.dtype), _TN, preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(1) - 1)
  def _store():
    dw_ref[...] = acc[...].astype(dw_ref.dtype)


def grads(cfg: FusedConfig, h, w, ids, lse, g, dh_dtype, dw_dtype, thr=None):
  """(dh [N, H], dw [H, V]) of sum_n g[n] * (z[n, id_n] - lse[n]) with z = (h @ w) / temperature.

  ``lse`` is the log-sum-exp over the whole vocabulary (all shards); ``g`` [N] f32 already includes
  the 1 / temperature factor; ``thr`` [N] f32 support thresholds or None (:func:`stats`).
  Gradients contract in the input dtype with f32 accumulation.
  """
  n, hd = h.shape
  v = w.shape[1]
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  col1 = lambda a: a.reshape(n, 1)
  gapped = thr is not None
  per_token = [col1(ids), col1(lse), col1(g), *_rows(n, thr)]
  row = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  dh = pl.pallas_call(
    functools.partial(_dh_kernel, cfg=cfg, gapped=gapped),
    grid=(pl.cdiv(n, bn), pl.cdiv(v, bv)),
    in_specs=[
      pl.BlockSpec((bn, hd), lambda i, j: (i, 0)),
      pl.BlockSpec((hd, bv), lambda i, j: (0, j)),
    ]
    + [row] * len(per_token),
    out_specs=pl.BlockSpec((bn, hd), lambda i, j: (i, 0)),
    out_shape=jax.ShapeDtypeStruct((n, hd), dh_dtype),
    scratch_shapes=[backend.scratch_vmem((bn, hd), jnp.float32)],
    compiler_params=_params(cfg, h, "dhidden", ("parallel", "arbitrary")),
    interpret=cfg.target.interpret,
    name="fused_linear_grpo_dhidden",
  )(h, w, *per_token)
  row_t = pl.BlockSpec((bn, 1), lambda j, i: (i, 0))
  dw = pl.pallas_call(
    functools.partial(_dw_kernel, cfg=cfg, n=n, gapped=gapped),
    grid=(pl.cdiv(v, bv), pl.cdiv(n, bn)),
    in_specs=[
      pl.BlockSpec((bn, hd), lambda j, i: (i, 0)),
      pl.BlockSpec((hd, bv), lambda j, i: (0, j)),
    ]
    + [row_t] * len(per_token),
    out_specs=pl.BlockSpec((hd, bv), lambda j, i: (0, j)),
    out_shape=jax.ShapeDtypeStruct((hd, v), dw_dtype),
    scratch_shapes=[backend.scratch_vmem((hd, bv), jnp.float32)],
    compiler_params=_params(cfg, h, "dweight", ("parallel", "arbitrary")),
    interpret=cfg.target.interpret,
    name="fused_linear_grpo_dweight",
  )(h, w, *per_token)
  return dh, dw
