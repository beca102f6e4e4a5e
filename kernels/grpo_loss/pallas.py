"""Pallas kernels for the GRPO loss over the vocabulary: the statistics forward and the backward.

Forward, per token row: an online max / sum-exp over vocabulary tiles (the tail masked in-kernel, never
padded in memory), the chosen token's logit and the entropy's running sum, finished in the last tile
into (log p, entropy) and the saved log-sum-exp.
Backward: dlogits = g / T * (onehot(id) - softmax(z)) tile by tile from the saved log-sum-exp, where
g = d loss / d log p; no f32 [N, V] array is ever built.

These are the three-pass pieces (statistics, then [B, T] objective, then backward): what runs for
sequence-level specs, for callers that differentiate aux outputs, and for the fused LM-head loss
(:mod:`kernels.fused_linear.chunked` calls :func:`row_stats` and :func:`softmax_grad`). The training
path for token-level specs is :mod:`kernels.grpo_loss.train` (one kernel: statistics, the in-kernel
coefficient, dlogits) under the custom VJP of :mod:`kernels.grpo_loss.vjp`.

Two families:
  tiled   (TPU, CPU interpreter): statistics over grid (rows / bn,), a [bn, V] row block in VMEM
                                  swept in register-sized slabs (:mod:`kernels.grpo_loss.tiles`);
                                  backward over grid (rows / bn, V / bv) tiles.
  rowloop (GPU / Triton):         grid (rows,), a fori_loop over vocab chunks with masked loads/stores;
                                  one block-wide max per chunk, per-lane sums reduced once per row
                                  (launch model: :func:`kernels.grpo_loss.blocks.rowloop_budget`).

All per-token inputs and outputs are flat f32 [N] (rowloop) or [N, 1] (tiled: a (bn, 1) block spans
the last dim, which satisfies Mosaic's tiling rule) arrays. The tiled statistics kernel takes the
chosen logits gathered outside (N elements); the training kernel reads them in-kernel (ids in SMEM).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend, lse
from kernels.backend import Target
from kernels.grpo_loss import tiles
from kernels.grpo_loss.blocks import LossBlocks


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static (hashable) settings of one kernel call."""

  target: Target
  blocks: LossBlocks
  vocab: int
  temperature: float
  reuse_logits_buffer: bool = False


finalize = tiles.finalize  # the rowloop kernels and train.py finish rows with it too


# ------------------------------------------------------------------------------------ tiled family
def _tiled_fwd_kernel(x_ref, chosen_ref, logp_ref, ent_ref, lse_ref, shift_ref, *, cfg):
  """A [bn, V] row block, row group by row group (:func:`tiles.row_stats`); chosen_ref: [bn, 1] the
  rows' chosen logits, gathered outside (N elements; the training kernel reads them in-kernel)."""
  bn, v = x_ref.shape
  sw = tiles.sweep_of(v, cfg.temperature, cfg.blocks.block_v, cfg.target.interpret)

  def rows_body(rows, size):
    stats = tiles.row_stats(x_ref, rows, size, sw, chosen_ref[rows, :])
    for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), stats):
      ref[rows, :] = val

  tiles.for_row_groups(bn, tiles.row_group(bn, x_ref.dtype), rows_body)


def _tiled_bwd_kernel(x_ref, ids_ref, lse_ref, shift_ref, g_ref, dx_ref, *, cfg: LossConfig):
  j = pl.program_id(1)
  x = x_ref[...].astype(jnp.float32)
  col = j * cfg.blocks.block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  p = jnp.exp((x * (1.0 / cfg.temperature) - shift_ref[...]) - lse_ref[...])
  onehot = (col == ids_ref[...]).astype(jnp.float32)
  g = g_ref[...]
  # g == 0 (a masked token): exactly 0, even where its logits are NaN / inf. Out-of-range columns are
  # dropped by the store.
  dx_ref[...] = jnp.where(g == 0, 0.0, g * (onehot - p)).astype(dx_ref.dtype)


def _tiled_fwd(cfg: LossConfig, x, ids):
  n, v = x.shape
  bn = tiles.stats_rows(cfg.blocks.block_n, n, v, x.dtype, cfg.target, blocks=1)
  chosen = tiles.chosen_logit(x, ids, v, cfg.temperature).reshape(n, 1)
  row_spec = pl.BlockSpec((bn, 1), lambda i: (i, 0))
  outs = pl.pallas_call(
    functools.partial(_tiled_fwd_kernel, cfg=cfg),
    grid=(pl.cdiv(n, bn),),
    in_specs=[pl.BlockSpec((bn, v), lambda i: (i, 0)), row_spec],
    out_specs=[row_spec] * 4,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * 4,
    compiler_params=backend.compiler_params(
      cfg.target,
      dimension_semantics=("parallel",),
      vmem_limit_bytes=tiles.vmem_bytes(bn, v, x.dtype, blocks=1),
    ),
    interpret=cfg.target.interpret,
    name="grpo_loss_fwd",
  )(x, chosen)
  return tuple(o.reshape(n) for o in outs)


def _tiled_bwd(cfg: LossConfig, x, ids, lse, shift, g):
  n, v = x.shape
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  tile = pl.BlockSpec((bn, bv), lambda i, j: (i, j))
  row_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  return pl.pallas_call(
    functools.partial(_tiled_bwd_kernel, cfg=cfg),
    grid=(pl.cdiv(n, bn), pl.cdiv(v, bv)),
    in_specs=[tile] + [row_spec] * 4,
    out_specs=tile,
    out_shape=jax.ShapeDtypeStruct((n, v), x.dtype),
    input_output_aliases={0: 0} if cfg.reuse_logits_buffer else {},
    compiler_params=backend.compiler_params(
      cfg.target, dimension_semantics=("parallel", "parallel")
    ),
    interpret=cfg.target.interpret,
    name="grpo_loss_bwd",
  )(x, *(a.reshape(n, 1) for a in (ids, lse, shift, g)))


# ---------------------------------------------------------------------------------- rowloop family
def rowloop_stats(x_ref, token, cfg: LossConfig):
  """(logp, entropy, lse_rel, shift) of one row: one sweep over its chunks.

  Per chunk one block-wide max; the sum-exp and entropy sums stay per lane until the row ends
  (:func:`kernels.lse.lane_update`), and the chosen logit is one scalar load, not a masked sum.
  """
  bv, vocab, inv_t = cfg.blocks.block_v, cfg.vocab, 1.0 / cfg.temperature

  def body(k, carry):
    cols = k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(k * bv, bv)], mask=valid, other=0.0).astype(jnp.float32)
    return lse.lane_update(jnp.where(valid, x * inv_t, -jnp.inf), valid, *carry)

  lanes = jnp.zeros((bv,), jnp.float32)
  m, l, s = jax.lax.fori_loop(0, pl.cdiv(vocab, bv), body, (jnp.float32(lse.NEG_BIG), lanes, lanes))
  found = (token >= 0) & (token < vocab)  # an id outside [0, V) poisons (NaN), never hides
  chosen = x_ref[jnp.where(found, token, 0)].astype(jnp.float32) * inv_t
  return finalize(m, jnp.sum(l), jnp.sum(s), chosen, found.astype(jnp.float32))


def rowloop_dlogits(x_ref, dx_ref, token, lse_rel, shift, g, cfg: LossConfig, reverse=False):
  """dx = g * (onehot(token) - softmax(z)) over one row, chunk by chunk (last chunk first when
  ``reverse``: right after a stats sweep those are the chunks most likely still in L2)."""
  bv, vocab = cfg.blocks.block_v, cfg.vocab
  chunks = pl.cdiv(vocab, bv)

  @pl.loop(0, chunks)
  def _chunk(i):
    k = chunks - 1 - i if reverse else i
    cols = k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(k * bv, bv)], mask=valid, other=0.0).astype(jnp.float32)
    p = jnp.exp((x * (1.0 / cfg.temperature) - shift) - lse_rel)
    d = jnp.where(g == 0, 0.0, g * ((cols == token).astype(jnp.float32) - p))  # see _tiled_bwd
    backend.masked_store(dx_ref.at[pl.ds(k * bv, bv)], d.astype(dx_ref.dtype), mask=valid)


def _rowloop_fwd_kernel(x_ref, ids_ref, logp_ref, ent_ref, lse_ref, shift_ref, *, cfg: LossConfig):
  stats = rowloop_stats(x_ref, ids_ref[...], cfg)
  for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), stats):
    ref[...] = val


def _rowloop_bwd_kernel(x_ref, ids_ref, lse_ref, shift_ref, g_ref, dx_ref, *, cfg: LossConfig):
  rowloop_dlogits(x_ref, dx_ref, ids_ref[...], lse_ref[...], shift_ref[...], g_ref[...], cfg)


def rowloop_params(cfg: LossConfig):
  return backend.compiler_params(
    cfg.target, num_warps=cfg.blocks.num_warps, num_stages=cfg.blocks.num_stages
  )


def _rowloop_fwd(cfg: LossConfig, x, ids):
  if cfg.blocks.splits > 1:
    return _rowloop_split_fwd(cfg, x, ids)
  n, v = x.shape
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  return tuple(
    pl.pallas_call(
      functools.partial(_rowloop_fwd_kernel, cfg=cfg),
      grid=(n,),
      in_specs=[pl.BlockSpec((None, v), lambda i: (i, 0)), scalar],
      out_specs=[scalar] * 4,
      out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 4,
      compiler_params=rowloop_params(cfg),
      interpret=cfg.target.interpret,
      name="grpo_loss_fwd",
    )(x, ids)
  )


def _rowloop_split_kernel(x_ref, m_ref, l_ref, s_ref, *, cfg: LossConfig, width: int):
  """Partial statistics of columns [s * width, (s + 1) * width) of one row (program (row, s))."""
  bv, vocab, inv_t = cfg.blocks.block_v, cfg.vocab, 1.0 / cfg.temperature
  start = pl.program_id(1) * width
  chunks = jnp.clip(pl.cdiv(vocab - start, bv), 0, width // bv)  # no fully out-of-range chunk

  def body(k, carry):
    cols = start + k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(start + k * bv, bv)], mask=valid, other=0.0)
    z = jnp.where(valid, x.astype(jnp.float32) * inv_t, -jnp.inf)
    return lse.lane_update(z, valid, *carry)

  lanes = jnp.zeros((bv,), jnp.float32)
  m, l, s = jax.lax.fori_loop(0, chunks, body, (jnp.float32(lse.NEG_BIG), lanes, lanes))
  m_ref[...], l_ref[...], s_ref[...] = m, jnp.sum(l), jnp.sum(s)


def _rowloop_split_fwd(cfg: LossConfig, x, ids):
  """The statistics kernel with ``splits`` programs per row; partials combined by log-sum-exp."""
  n, v = x.shape
  bv, splits = cfg.blocks.block_v, cfg.blocks.splits
  width = pl.cdiv(pl.cdiv(v, splits), bv) * bv
  part = pl.BlockSpec((None, None), lambda i, s: (i, s))
  m, l, s = pl.pallas_call(
    functools.partial(_rowloop_split_kernel, cfg=cfg, width=width),
    grid=(n, splits),
    in_specs=[pl.BlockSpec((None, v), lambda i, s: (i, 0))],
    out_specs=[part] * 3,
    out_shape=[jax.ShapeDtypeStruct((n, splits), jnp.float32)] * 3,
    compiler_params=rowloop_params(cfg),
    interpret=cfg.target.interpret,
    name="grpo_loss_fwd_split",
  )(x)
  top, l_row, s_row = lse.merge(m, l, s, axis=1)
  found = (ids >= 0) & (ids < v)
  chosen = tiles.chosen_logit(x, ids, v, cfg.temperature)
  return finalize(top[:, 0], l_row[:, 0], s_row[:, 0], chosen, found.astype(jnp.float32))


def _rowloop_bwd(cfg: LossConfig, x, ids, lse, shift, g):
  n, v = x.shape
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  row = pl.BlockSpec((None, v), lambda i: (i, 0))
  return pl.pallas_call(
    functools.partial(_rowloop_bwd_kernel, cfg=cfg),
    grid=(n,),
    in_specs=[row] + [scalar] * 4,
    out_specs=row,
    out_shape=jax.ShapeDtypeStruct((n, v), x.dtype),
    input_output_aliases={0: 0} if cfg.reuse_logits_buffer else {},
    compiler_params=rowloop_params(cfg),
    interpret=cfg.target.interpret,
    name="grpo_loss_bwd",
  )(x, ids, lse, shift, g)


# ------------------------------------------------------------------------------ differentiable op
def _fwd_call(cfg, *args):
  return (_rowloop_fwd if cfg.target.family == "rowloop" else _tiled_fwd)(cfg, *args)


def _bwd_call(cfg, *args):
  return (_rowloop_bwd if cfg.target.family == "rowloop" else _tiled_bwd)(cfg, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def token_logps(cfg: LossConfig, logits, ids):
  """(logp, entropy) of flat tokens, [N] f32 each; differentiable w.r.t. logits through logp.

  logits: [N, V] bf16/f32; ids: [N] int32 (outside [0, V): logp NaN). The entropy carries no gradient.
  """
  logp, ent, _, _ = _fwd_call(cfg, logits, ids)
  return logp, ent


def _vjp_fwd(cfg, logits, ids):
  logp, ent, lse_rel, shift = _fwd_call(cfg, logits, ids)
  return (logp, ent), (logits, ids, lse_rel, shift)


def _vjp_bwd(cfg, res, cts):
  logits, ids, lse_rel, shift = res
  ct_logp, _ = cts  # the entropy carries no gradient
  # A zero cotangent (a masked token) gives exactly 0 in the kernel, even where its logits are NaN.
  g = ct_logp * (1.0 / cfg.temperature)
  return _bwd_call(cfg, logits, ids, lse_rel, shift, g), None


token_logps.defvjp(_vjp_fwd, _vjp_bwd)


# --------------------------------------------------------------- building blocks for other ops
def row_stats(cfg: LossConfig, logits, ids):
  """(lse, logp, entropy) per row of [N, V] logits (scaled by 1 / temperature), from the forward kernel.

  logp is NaN where the id is outside [0, V) (the fused LM-head loss uses this to find which vocabulary
  shard holds a token).
  """
  logp, entropy, lse_rel, shift = _fwd_call(cfg, logits, ids)
  return shift + lse_rel, logp, entropy


def softmax_grad(cfg: LossConfig, logits, ids, lse, g):
  """g[n] * (onehot(id_n) - exp(z[n] - lse[n])) with z = logits / temperature, from the backward kernel."""
  return _bwd_call(cfg, logits, ids, lse, jnp.zeros_like(lse), g)
