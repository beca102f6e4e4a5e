"""Fused Pallas kernels for the LM-head GRPO loss: logits live only as VMEM tiles, never in HBM.

Three pallas_calls over flat tokens (h [N, H], w [H, V] one vocabulary shard, ids [N] shard-local):

  stats   grid (N/bn, V/bv, H/bh): the f32 logits tile accumulates over H in VMEM, then folds into the
          online max / sum-exp / E[z] / chosen-logit statistics of each row (grpo_loss's update).
  dhidden grid (N/bn, V/bv):       recomputes each logits tile, dl = g * (onehot - softmax) from the
          (global) log-sum-exp, and accumulates dl @ w^T into a [bn, H] f32 VMEM accumulator.
  dweight grid (V/bv, N/bn):       the same tile recomputed, accumulating h^T @ dl into [H, bv].

The gradients cost two extra logits recomputations (10 N·H·V flops in all against 6 for a path that
stores logits): that is the price of O(tile) memory, and why `chunked` is the default where it fits.
This is the tiled family (TPU Mosaic, CPU interpreter); a GPU program cannot accumulate across a grid
axis, and Triton cannot hold the [bn, H] / [H, bv] accumulators in registers, so GPU runs `chunked`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend
from kernels.backend import Target
from kernels.fused_linear.pallas_blocks import LinearBlocks, kernel_vmem_bytes
from kernels.lse import NEG_BIG, online_update
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


def _stats_kernel(
  h_ref,
  w_ref,
  ids_ref,
  lse_ref,
  chosen_ref,
  found_ref,
  ez_ref,
  acc,
  m_sc,
  l_sc,
  s_sc,
  c_sc,
  f_sc,
  *,
  cfg: FusedConfig,
):
  j, k = pl.program_id(1), pl.program_id(2)

  @pl.when((j == 0) & (k == 0))
  def _init_row():
    m_sc[...] = jnp.full_like(m_sc, NEG_BIG)
    for ref in (l_sc, s_sc, c_sc, f_sc):
      ref[...] = jnp.zeros_like(ref)

  @pl.when(k == 0)
  def _init_tile():
    acc[...] = jnp.zeros_like(acc)

  acc[...] += jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32)

  @pl.when(k == pl.num_programs(2) - 1)
  def _fold():
    col, valid = _cols(j, acc.shape, cfg)
    z = jnp.where(valid, acc[...] * (1.0 / cfg.temperature), -jnp.inf)
    m, l, s, c, f = online_update(
      z, col == ids_ref[...], valid, m_sc[...], l_sc[...], s_sc[...], c_sc[...], f_sc[...], axis=1
    )
    m_sc[...], l_sc[...], s_sc[...], c_sc[...], f_sc[...] = m, l, s, c, f

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
      lse_ref[...] = m + jnp.log(l)
      chosen_ref[...] = c
      found_ref[...] = f
      ez_ref[...] = m + s / l  # E_softmax[z]: s accumulates p * (z - m)


def stats(cfg: FusedConfig, h, w, ids):
  """Per-row (lse, chosen z, found, E[z]) of z = (h @ w) / temperature over this shard's columns.

  h: [N, H]; w: [H, V]; ids: [N] int32 shard-local (outside [0, V): not in this shard). All f32 [N].
  """
  n, hd = h.shape
  v = w.shape[1]
  bn, bv, bh = cfg.blocks.block_n, cfg.blocks.block_v, cfg.blocks.block_h
  row = pl.BlockSpec((bn, 1), lambda i, j, k: (i, 0))
  outs = pl.pallas_call(
    functools.partial(_stats_kernel, cfg=cfg),
    grid=(pl.cdiv(n, bn), pl.cdiv(v, bv), hd // bh),
    in_specs=[
      pl.BlockSpec((bn, bh), lambda i, j, k: (i, k)),
      pl.BlockSpec((bh, bv), lambda i, j, k: (k, j)),
      row,
    ],
    out_specs=[row] * 4,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * 4,
    scratch_shapes=[backend.scratch_vmem((bn, bv), jnp.float32)]
    + [backend.scratch_vmem((bn, 1), jnp.float32)] * 5,
    compiler_params=_params(cfg, h, "stats", ("parallel", "arbitrary", "arbitrary")),
    interpret=cfg.target.interpret,
    name="fused_linear_grpo_stats",
  )(h, w, ids.reshape(n, 1))
  return tuple(o.reshape(n) for o in outs)


def _dlogits(h, w, ids, lse, g, col, valid, cfg):
  """dl = g * (onehot(id) - softmax(z)) for one recomputed tile; zero outside the vocabulary."""
  z = jnp.dot(h, w, preferred_element_type=jnp.float32) * (1.0 / cfg.temperature)
  p = jnp.exp(z - lse)
  return jnp.where(valid, g * ((col == ids).astype(jnp.float32) - p), 0.0)


def _zero_tail_columns(w_ref, j, cfg: FusedConfig):
  """Zero the weight tile's columns past V in the last vocabulary step: its DMA left garbage there
  (maybe NaN, and 0 * NaN is NaN in dl @ w^T). A store into the input window, in the tail step only;
  a select over the whole [H, bv] tile with an iota mask is a relayout Mosaic rejects
  (``vector<HxBVxi1>``), and would cost a pass over the tile at every step."""
  bv = cfg.blocks.block_v
  tail = cfg.vocab % bv
  if tail == 0:
    return

  @pl.when(j == pl.num_programs(1) - 1)
  def _zero():
    w_ref[:, tail:] = jnp.zeros((w_ref.shape[0], bv - tail), w_ref.dtype)


def _dh_kernel(h_ref, w_ref, ids_ref, lse_ref, g_ref, dh_ref, acc, *, cfg: FusedConfig):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    acc[...] = jnp.zeros_like(acc)

  _zero_tail_columns(w_ref, j, cfg)
  h, w = h_ref[...], w_ref[...]
  col, valid = _cols(j, (h.shape[0], cfg.blocks.block_v), cfg)
  dl = _dlogits(h, w, ids_ref[...], lse_ref[...], g_ref[...], col, valid, cfg)
  acc[...] += jax.lax.dot_general(dl.astype(w.dtype), w, _NT, preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _store():
    dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, ids_ref, lse_ref, g_ref, dw_ref, acc, *, cfg: FusedConfig, n: int):
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    acc[...] = jnp.zeros_like(acc)

  bn = cfg.blocks.block_n
  rows = i * bn + jax.lax.broadcasted_iota(jnp.int32, (bn, 1), 0)
  h = jnp.where(rows < n, h_ref[...], 0)  # the tail tile's rows past N hold garbage
  col, valid = _cols(j, (bn, cfg.blocks.block_v), cfg)
  dl = _dlogits(h, w_ref[...], ids_ref[...], lse_ref[...], g_ref[...], col, valid & (rows < n), cfg)
  acc[...] += jax.lax.dot_general(h, dl.astype(h.dtype), _TN, preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(1) - 1)
  def _store():
    dw_ref[...] = acc[...].astype(dw_ref.dtype)


def grads(cfg: FusedConfig, h, w, ids, lse, g, dh_dtype, dw_dtype):
  """(dh [N, H], dw [H, V]) of sum_n g[n] * (z[n, id_n] - lse[n]) with z = (h @ w) / temperature.

  ``lse`` is the log-sum-exp over the whole vocabulary (all shards); ``g`` [N] f32 already includes
  the 1 / temperature factor. Gradients contract in the input dtype with f32 accumulation.
  """
  n, hd = h.shape
  v = w.shape[1]
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  col1 = lambda a: a.reshape(n, 1)
  per_token = [col1(ids), col1(lse), col1(g)]
  row = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  dh = pl.pallas_call(
    functools.partial(_dh_kernel, cfg=cfg),
    grid=(pl.cdiv(n, bn), pl.cdiv(v, bv)),
    in_specs=[
      pl.BlockSpec((bn, hd), lambda i, j: (i, 0)),
      pl.BlockSpec((hd, bv), lambda i, j: (0, j)),
    ]
    + [row] * 3,
    out_specs=pl.BlockSpec((bn, hd), lambda i, j: (i, 0)),
    out_shape=jax.ShapeDtypeStruct((n, hd), dh_dtype),
    scratch_shapes=[backend.scratch_vmem((bn, hd), jnp.float32)],
    compiler_params=_params(cfg, h, "dhidden", ("parallel", "arbitrary")),
    interpret=cfg.target.interpret,
    name="fused_linear_grpo_dhidden",
  )(h, w, *per_token)
  row_t = pl.BlockSpec((bn, 1), lambda j, i: (i, 0))
  dw = pl.pallas_call(
    functools.partial(_dw_kernel, cfg=cfg, n=n),
    grid=(pl.cdiv(v, bv), pl.cdiv(n, bn)),
    in_specs=[
      pl.BlockSpec((bn, hd), lambda j, i: (i, 0)),
      pl.BlockSpec((hd, bv), lambda j, i: (0, j)),
    ]
    + [row_t] * 3,
    out_specs=pl.BlockSpec((hd, bv), lambda j, i: (0, j)),
    out_shape=jax.ShapeDtypeStruct((hd, v), dw_dtype),
    scratch_shapes=[backend.scratch_vmem((hd, bv), jnp.float32)],
    compiler_params=_params(cfg, h, "dweight", ("parallel", "arbitrary")),
    interpret=cfg.target.interpret,
    name="fused_linear_grpo_dweight",
  )(h, w, *per_token)
  return dh, dw
