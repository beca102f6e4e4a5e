"""The fused LM-head loss's gradients in one Pallas kernel: each logits tile recomputed once feeds
both dh and dw (8 N·H·V flops with the statistics pass, against 10 for separate dhidden / dweight
kernels that each recompute it).

grid (V/bv, R/bn), vocabulary outer: per step the logits tile z = h_i @ w_j is recomputed,
dl = g * (onehot - softmax(z)) formed from the global log-sum-exp, and

  dw_j  += h_i^T @ dl     a [H, bv] f32 VMEM accumulator over the row blocks (one vocabulary block
                          at a time: written once, when j moves on)
  dh_i  += dl @ w_j^T     a [R, H] f32 VMEM accumulator resident for the whole grid (every vocabulary
                          block adds to every row block), DMA'd to HBM once at the last step

so no [N, V] array and no partial dh / dw ever goes through HBM. R, the rows one call holds, is bounded
by VMEM (:func:`.pallas_blocks.fused_rows`): more tokens run as several calls over row superblocks,
each adding its rows' dw into the previous call's f32 dw (an aliased input the accumulator starts
from), so a superblock costs one more read of w and one f32 read + write of dw. Where not even
2 x block_n rows fit (v4's 16 MiB at H = 2048), :func:`.pallas_tpu.grads`' two kernels run instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend
from kernels.fused_linear import pallas_tpu as _pallas
from kernels.fused_linear.pallas_blocks import fused_rows, fused_vmem_bytes
from kernels.fused_linear.pallas_tpu import FusedConfig, _cols, _dlogits, _rows, _zero_tail_columns
from kernels.tpu_vmem import vmem_limit

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _kernel(*refs, cfg: FusedConfig, rows: int, carry: bool, gapped: bool):
  """refs: h, w, ids, lse, g, [dw_in (carry)], [thr (gapped)], dw, dh (HBM), dw_acc, dh_acc, sem."""
  h_ref, w_ref, ids_ref, lse_ref, g_ref = refs[:5]
  dw_in = refs[5] if carry else None
  thr = refs[5 + carry][...] if gapped else None  # [bn, 1] support thresholds
  dw_ref, dh_hbm, dw_acc, dh_acc, sem = refs[5 + carry + gapped :]
  j, i = pl.program_id(0), pl.program_id(1)
  bn = cfg.blocks.block_n

  _zero_tail_columns(w_ref, j, cfg, axis=0)
  h, w = h_ref[...], w_ref[...]
  col, valid = _cols(j, (bn, cfg.blocks.block_v), cfg)
  if rows % bn:  # the tail row block's rows past R hold garbage (maybe NaN): zero h and dl there
    live = i * bn + jax.lax.broadcasted_iota(jnp.int32, (bn, 1), 0) < rows
    h, valid = jnp.where(live, h, 0), valid & live
  dl = _dlogits(h, w, ids_ref[...], lse_ref[...], g_ref[...], col, valid, cfg, thr).astype(h.dtype)
  # Accumulators start by a select, not in a pl.when branch: a branch over the whole [R, H] or
  # [H, bv] buffer is code every grid step issues (or skips) and the static schedule counts.
  # (A select, not a multiply: the first visit reads uninitialised VMEM, maybe NaN.)
  dw_start = dw_in[...] if carry else 0.0
  dw = jnp.where(i == 0, dw_start, dw_acc[...])
  dw = dw + jax.lax.dot_general(h, dl, _TN, preferred_element_type=jnp.float32)
  dw_acc[...] = dw
  dw_ref[...] = dw.astype(dw_ref.dtype)  # the last row block's is what reaches HBM
  at = pl.ds(pl.multiple_of(i * bn, bn), bn)
  dh = jnp.where(j == 0, 0.0, dh_acc[at, :])
  dh_acc[at, :] = dh + jax.lax.dot_general(dl, w, _NT, preferred_element_type=jnp.float32)

  @pl.when((j == pl.num_programs(0) - 1) & (i == pl.num_programs(1) - 1))
  def _store_dh():
    copy = backend._tpu_module().make_async_copy(dh_acc.at[pl.ds(0, rows)], dh_hbm, sem)
    copy.start()
    copy.wait()


def _call(cfg: FusedConfig, h, w, ids, lse, g, dw_in, dw_dtype, thr=None):
  """One kernel over rows h [R, H] (R <= fused_rows): (dh [R, H] f32, dw [H, V] in dw_dtype, plus
  dw_in [H, V] f32 when given; thr [R] f32 support thresholds or None)."""
  rows, hd = h.shape
  v = w.shape[1]
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  grid_rows = pl.cdiv(rows, bn)
  row = pl.BlockSpec((bn, 1), lambda j, i: (i, 0))
  vocab = pl.BlockSpec((hd, bv), lambda j, i: (0, j))
  carry, gapped = dw_in is not None, thr is not None
  tpu = backend._tpu_module()
  need = fused_vmem_bytes(cfg.blocks, grid_rows * bn, hd, h.dtype.itemsize, carry)
  params = backend.compiler_params(
    cfg.target,
    dimension_semantics=("arbitrary", "arbitrary"),  # dh accumulates over both axes
    vmem_limit_bytes=vmem_limit(cfg.target, need),
  )
  col1 = lambda a: a.reshape(rows, 1)
  dw, dh = pl.pallas_call(
    functools.partial(_kernel, cfg=cfg, rows=rows, carry=carry, gapped=gapped),
    grid=(pl.cdiv(v, bv), grid_rows),
    in_specs=[pl.BlockSpec((bn, hd), lambda j, i: (i, 0)), vocab, row, row, row]
    + [vocab] * carry
    + [row] * gapped,
    out_specs=[vocab, pl.BlockSpec(memory_space=tpu.HBM)],
    out_shape=[
      jax.ShapeDtypeStruct((hd, v), dw_dtype),
      jax.ShapeDtypeStruct((rows, hd), jnp.float32),
    ],
    scratch_shapes=[
      backend.scratch_vmem((hd, bv), jnp.float32),
      backend.scratch_vmem((grid_rows * bn, hd), jnp.float32),
      tpu.SemaphoreType.DMA,
    ],
    input_output_aliases={5: 0} if carry and jnp.dtype(dw_dtype) == jnp.float32 else {},
    compiler_params=params,
    interpret=cfg.target.interpret,
    name="fused_linear_grpo_grads",
  )(h, w, col1(ids), col1(lse), col1(g), *([dw_in] if carry else []), *_rows(rows, thr))
  return dh, dw


def grads(
  cfg: FusedConfig, h, w, ids, lse, g, dh_dtype, dw_dtype, rows: int | None = None, thr=None
):
  """(dh [N, H], dw [H, V]) as :func:`.pallas_tpu.grads`, in one kernel per row superblock of
  :func:`.pallas_blocks.fused_rows` rows (``rows``: a smaller superblock, for tests); where none
  fits, the two kernels of :func:`.pallas_tpu.grads`. ``thr``: [N] f32 support thresholds or None."""
  n, hd = h.shape
  r = rows or fused_rows(
    cfg.blocks, n, hd, h.dtype.itemsize, cfg.target
  )  # rows: tests' superblocks
  if r == 0:
    return _pallas.grads(cfg, h, w, ids, lse, g, dh_dtype, dw_dtype, thr)
  if n <= r:
    dh, dw = _call(cfg, h, w, ids, lse, g, None, dw_dtype, thr)
    return dh.astype(dh_dtype), dw
  dhs, dw = [], None
  for start in range(0, n, r):  # superblocks: dw carried in f32 from one call to the next
    part = slice(start, min(n, start + r))
    last = start + r >= n
    part_thr = None if thr is None else thr[part]
    dh, dw = _call(cfg, h[part], w, ids[part], lse[part], g[part], dw, dw_dtype if last else jnp.float32, part_thr)  # fmt: skip
    dhs.append(dh)
  return jnp.concatenate(dhs).astype(dh_dtype), dw
