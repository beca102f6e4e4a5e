"""Pallas kernels of the GRPO loss for the rowloop family (GPU, lowered by Triton).

Grid (rows,): one program per row, a fori_loop over vocabulary chunks with masked loads and stores;
one block-wide max per chunk, per-lane sums reduced once per row (launch model:
:func:`kernels.grpo_loss.pallas_blocks.rowloop_budget`). With ``splits`` > 1 the statistics kernel
runs that many programs per row, their partials combined exactly by log-sum-exp.
Training path (:func:`train_fwd`, token-level specs): grid (rows,); the stats sweep, then the
dlogits sweep in reverse chunk order, so it starts on the chunks the first sweep read last, the ones
still in L2 (a 297 KB row; :func:`kernels.grpo_loss.pallas_blocks.rowloop_budget` models whether the
rows being swept fit in L2, which decides whether the second sweep costs HBM reads).

With a support gap every sweep (statistics, split statistics, dlogits) gaps its scaled chunk by the
row's threshold (:func:`kernels.support.gapped`, y kept by its column). Per-token inputs and
outputs are flat f32 [N]. :mod:`kernels.grpo_loss.pallas` picks this family or
the tiled one (:mod:`kernels.grpo_loss.pallas_tpu`) by the target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend, lse, support
from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.grpo_loss.train import TrainConfig, coefficient


def _gap(z, thr, cols, token):
  """The chunk's scaled logits over S (:func:`kernels.support.gapped`, y kept by its column), or
  z itself without a gap (thr None: the kernel as without one)."""
  return z if thr is None else support.gapped(z, thr, cols == token)


def rowloop_stats(x_ref, token, cfg: LossConfig, thr=None):
  """(logp, entropy, lse_rel, shift) of one row: one sweep over its chunks; thr: the row's support
  threshold (a scalar) or None.

  Per chunk one block-wide max; the sum-exp and entropy sums stay per lane until the row ends
  (:func:`kernels.lse.lane_update`), and the chosen logit is one scalar load, not a masked sum.
  """
  bv, vocab, inv_t = cfg.blocks.block_v, cfg.vocab, 1.0 / cfg.temperature

  def body(k, carry):
    cols = k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(k * bv, bv)], mask=valid, other=0.0).astype(jnp.float32)
    z = _gap(jnp.where(valid, x * inv_t, -jnp.inf), thr, cols, token)
    return lse.lane_update(z, valid, *carry)

  lanes = jnp.zeros((bv,), jnp.float32)
  m, l, s = jax.lax.fori_loop(0, pl.cdiv(vocab, bv), body, (jnp.float32(lse.NEG_BIG), lanes, lanes))
  found = (token >= 0) & (token < vocab)  # an id outside [0, V) poisons (NaN), never hides
  chosen = x_ref[jnp.where(found, token, 0)].astype(jnp.float32) * inv_t
  return lse.finalize(m, jnp.sum(l), jnp.sum(s), chosen, found.astype(jnp.float32))


def rowloop_dlogits(x_ref, dx_ref, token, lse_rel, shift, g, cfg: LossConfig, reverse=False, thr=None):  # fmt: skip
  """dx = g * (onehot(token) - softmax(z)) over one row, chunk by chunk (last chunk first when
  ``reverse``: right after a stats sweep those are the chunks most likely still in L2); softmax
  over S (0 outside it) with a support threshold ``thr``."""
  bv, vocab = cfg.blocks.block_v, cfg.vocab
  chunks = pl.cdiv(vocab, bv)

  @pl.loop(0, chunks)
  def _chunk(i):
    k = chunks - 1 - i if reverse else i
    cols = k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(k * bv, bv)], mask=valid, other=0.0).astype(jnp.float32)
    z = _gap(x * (1.0 / cfg.temperature), thr, cols, token)
    p = jnp.exp((z - shift) - lse_rel)
    d = jnp.where(g == 0, 0.0, g * ((cols == token).astype(jnp.float32) - p))  # see _tiled_bwd
    backend.masked_store(dx_ref.at[pl.ds(k * bv, bv)], d.astype(dx_ref.dtype), mask=valid)


def _rowloop_fwd_kernel(x_ref, ids_ref, *refs, cfg: LossConfig, gapped: bool):
  """refs: ([thr_ref,] logp, entropy, lse_rel, shift)."""
  thr = refs[0][...] if gapped else None
  stats = rowloop_stats(x_ref, ids_ref[...], cfg, thr)
  for ref, val in zip(refs[gapped:], stats):
    ref[...] = val


def _rowloop_bwd_kernel(x_ref, ids_ref, lse_ref, shift_ref, g_ref, *refs, cfg: LossConfig):
  """refs: ([thr_ref,] dx_ref)."""
  thr = refs[0][...] if len(refs) == 2 else None
  rows = (ids_ref[...], lse_ref[...], shift_ref[...], g_ref[...])
  rowloop_dlogits(x_ref, refs[-1], *rows, cfg, thr=thr)


def rowloop_params(cfg: LossConfig):
  return backend.compiler_params(
    cfg.target, num_warps=cfg.blocks.num_warps, num_stages=cfg.blocks.num_stages
  )


def fwd(cfg: LossConfig, x, ids, thr=None):
  """(logp, entropy, lse_rel, shift) [N] f32 of logits x [N, V] and ids [N]; thr: [N] f32 support
  thresholds or None."""
  if cfg.blocks.splits > 1:
    return _rowloop_split_fwd(cfg, x, ids, thr)
  n, v = x.shape
  rows = (ids,) + (() if thr is None else (thr,))
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  return tuple(
    pl.pallas_call(
      functools.partial(_rowloop_fwd_kernel, cfg=cfg, gapped=thr is not None),
      grid=(n,),
      in_specs=[pl.BlockSpec((None, v), lambda i: (i, 0))] + [scalar] * len(rows),
      out_specs=[scalar] * 4,
      out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 4,
      compiler_params=rowloop_params(cfg),
      interpret=cfg.target.interpret,
      name="grpo_loss_fwd",
    )(x, *rows)
  )


def _rowloop_split_kernel(x_ref, *refs, cfg: LossConfig, width: int):
  """Partial statistics of columns [s * width, (s + 1) * width) of one row (program (row, s));
  refs: ([ids_ref, thr_ref,] m, l, s), the row's id and support threshold when gapped."""
  token, thr = (refs[0][...], refs[1][...]) if len(refs) == 5 else (None, None)
  m_ref, l_ref, s_ref = refs[-3:]
  bv, vocab, inv_t = cfg.blocks.block_v, cfg.vocab, 1.0 / cfg.temperature
  start = pl.program_id(1) * width
  chunks = jnp.clip(pl.cdiv(vocab - start, bv), 0, width // bv)  # no fully out-of-range chunk

  def body(k, carry):
    cols = start + k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(start + k * bv, bv)], mask=valid, other=0.0)
    z = _gap(jnp.where(valid, x.astype(jnp.float32) * inv_t, -jnp.inf), thr, cols, token)
    return lse.lane_update(z, valid, *carry)

  lanes = jnp.zeros((bv,), jnp.float32)
  m, l, s = jax.lax.fori_loop(0, chunks, body, (jnp.float32(lse.NEG_BIG), lanes, lanes))
  m_ref[...], l_ref[...], s_ref[...] = m, jnp.sum(l), jnp.sum(s)


def _rowloop_split_fwd(cfg: LossConfig, x, ids, thr):
  """The statistics kernel with ``splits`` programs per row; partials combined by log-sum-exp."""
  n, v = x.shape
  bv, splits = cfg.blocks.block_v, cfg.blocks.splits
  width = pl.cdiv(pl.cdiv(v, splits), bv) * bv
  part = pl.BlockSpec((None, None), lambda i, s: (i, s))
  rows = () if thr is None else (ids, thr)
  m, l, s = pl.pallas_call(
    functools.partial(_rowloop_split_kernel, cfg=cfg, width=width),
    grid=(n, splits),
    in_specs=[pl.BlockSpec((None, v), lambda i, s: (i, 0))]
    + [pl.BlockSpec((None,), lambda i, s: (i,))] * len(rows),
    out_specs=[part] * 3,
    out_shape=[jax.ShapeDtypeStruct((n, splits), jnp.float32)] * 3,
    compiler_params=rowloop_params(cfg),
    interpret=cfg.target.interpret,
    name="grpo_loss_fwd_split",
  )(x, *rows)
  top, l_row, s_row = lse.merge(m, l, s, axis=1)
  found = (ids >= 0) & (ids < v)
  chosen = lse.chosen_logit(x, ids, v, cfg.temperature)
  return lse.finalize(top[:, 0], l_row[:, 0], s_row[:, 0], chosen, found.astype(jnp.float32))


def bwd(cfg: LossConfig, x, ids, lse, shift, g, thr=None):
  """dlogits [N, V] in x's dtype from the saved (lse, shift) and g = d loss / d z_chosen [N]; thr:
  [N] f32 support thresholds or None."""
  n, v = x.shape
  rows = (ids, lse, shift, g) + (() if thr is None else (thr,))
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  row = pl.BlockSpec((None, v), lambda i: (i, 0))
  return pl.pallas_call(
    functools.partial(_rowloop_bwd_kernel, cfg=cfg),
    grid=(n,),
    in_specs=[row] + [scalar] * len(rows),
    out_specs=row,
    out_shape=jax.ShapeDtypeStruct((n, v), x.dtype),
    input_output_aliases={0: 0} if cfg.reuse_logits_buffer else {},
    compiler_params=rowloop_params(cfg),
    interpret=cfg.target.interpret,
    name="grpo_loss_bwd",
  )(x, *rows)


# ------------------------------------------------------------------------------- training path
def _rowloop_train_kernel(x_ref, ids_ref, *refs, cfg: TrainConfig, gapped: bool):
  """refs: the per-token inputs (cfg.fields), [thr_ref,] then the outputs."""
  k = len(cfg.fields)
  tok = {name: ref[...] for name, ref in zip(cfg.fields, refs[:k])}
  thr = refs[k][...] if gapped else None
  logp_ref, ent_ref, lse_ref, shift_ref, dx_ref = refs[k + gapped :]
  token = ids_ref[...]
  logp, ent, lse_rel, shift = rowloop_stats(x_ref, token, cfg.loss, thr)
  g = coefficient(cfg, logp, tok)
  rowloop_dlogits(x_ref, dx_ref, token, lse_rel, shift, g, cfg.loss, reverse=True, thr=thr)
  for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), (logp, ent, lse_rel, shift)):
    ref[...] = val


def train_fwd(cfg: TrainConfig, x, ids, tok, thr=None):
  """(logp, entropy, lse_rel, shift [N] f32, dlogits [N, V]) of the training path; thr: [N] f32
  support thresholds or None."""
  n, v = x.shape
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  row = pl.BlockSpec((None, v), lambda i: (i, 0))
  k = tok.shape[1]
  rows = tuple(tok[:, i] for i in range(k)) + (() if thr is None else (thr,))
  return tuple(
    pl.pallas_call(
      functools.partial(_rowloop_train_kernel, cfg=cfg, gapped=thr is not None),
      grid=(n,),
      in_specs=[row] + [scalar] * (1 + len(rows)),
      out_specs=[scalar] * 4 + [row],
      out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 4
      + [jax.ShapeDtypeStruct((n, v), x.dtype)],
      input_output_aliases={0: 4} if cfg.loss.reuse_logits_buffer else {},
      compiler_params=rowloop_params(cfg.loss),
      interpret=cfg.loss.target.interpret,
      name="grpo_loss_train",
    )(x, ids, *rows)
  )
