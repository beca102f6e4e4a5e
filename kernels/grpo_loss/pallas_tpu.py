"""Pallas kernels of the GRPO loss for the tiled family (Mosaic TPU, and the CPU interpreter of it).

Statistics forward over grid (rows / bn,): a [bn, V] row block in VMEM swept in register-sized slabs
(:mod:`kernels.grpo_loss.pallas_tpu_sweeps`), the online max / sum-exp and the entropy's running sum
finished into (log p, entropy) and the saved log-sum-exp; the vocabulary tail is masked in-kernel,
never padded in memory. The chosen logits are gathered outside (N elements).
Backward over grid (rows / bn, V / bv) tiles: dlogits = g / T * (onehot(id) - softmax(z)) from the saved
log-sum-exp, where g = d loss / d log p; no f32 [N, V] array is ever built.
Training path (:func:`train_fwd`, token-level specs): grid (rows / bn,); a [bn, V] row block stays in
VMEM (in and out, double-buffered: bn from :func:`kernels.grpo_loss.pallas_blocks.stats_rows`)
and each group of 16 rows is swept from VMEM in 128-lane slabs: the statistics
(:func:`kernels.grpo_loss.pallas_tpu_sweeps.lane_stats`), then -g * softmax written, then each row's
chosen column patched (ids in SMEM): the logits leave HBM once, dlogits once.
Where a [rows, V] block outgrows the generation's VMEM (``LossBlocks.vocab_tiled``, the heuristic's
choice: v4 at f32 V 128256 / 151936 or bf16 V 262144), the statistics run over (rows, vocabulary)
tiles (:mod:`kernels.grpo_loss.pallas_tpu_vocab`: one sweep against the chosen logit, an exact
fallback for flagged rows) and the training path is that pass then its slab-swept backward kernel:
two reads of the logits, one write of dlogits.

Per-token inputs and outputs are [N, 1] f32 (a (bn, 1) block spans the last dim, which satisfies
Mosaic's tiling rule). :mod:`kernels.grpo_loss.pallas` picks this family or the Triton one
(:mod:`kernels.grpo_loss.pallas_triton`) by the target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import backend, lse, support
from kernels.grpo_loss import pallas_blocks, pallas_tpu_vocab
from kernels.grpo_loss import pallas_tpu_sweeps as sweeps
from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.grpo_loss.train import TrainConfig, coefficient


def _tiled_fwd_kernel(x_ref, chosen_ref, *refs, cfg, gapped: bool):
  """A [bn, V] row block, row group by row group (:func:`kernels.grpo_loss.pallas_tpu_sweeps.row_stats`); chosen_ref: [bn, 1] the
  rows' chosen logits, gathered outside (N elements; the training kernel reads them in-kernel);
  ``gapped``: refs starts with the rows' [bn, 1] support thresholds."""
  thr_ref, (logp_ref, ent_ref, lse_ref, shift_ref) = (refs[0], refs[1:]) if gapped else (None, refs)
  bn, v = x_ref.shape
  sw = sweeps.sweep_of(v, cfg.temperature, cfg.blocks.block_v, cfg.target.interpret, gapped)

  def rows_body(rows, size):
    thr = thr_ref[rows, :] if gapped else None
    stats = sweeps.row_stats(x_ref, rows, size, sw, chosen_ref[rows, :], thr)
    for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), stats):
      ref[rows, :] = val

  sweeps.for_row_groups(bn, sweeps.row_group(bn, x_ref.dtype), rows_body)


def _tiled_bwd_kernel(x_ref, ids_ref, lse_ref, shift_ref, g_ref, *refs, cfg: LossConfig):
  """One [bn, bv] tile of dlogits; refs: ([thr_ref,] dx_ref), thr_ref the rows' [bn, 1] support
  thresholds when gapped (columns outside S get p = 0; y is kept by the onehot's own compare)."""
  dx_ref = refs[-1]
  j = pl.program_id(1)
  x = x_ref[...].astype(jnp.float32)
  col = j * cfg.blocks.block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  hit = col == ids_ref[...]
  z = x * (1.0 / cfg.temperature)
  if len(refs) == 2:
    z = support.gapped(z, refs[0][...], hit)
  p = jnp.exp((z - shift_ref[...]) - lse_ref[...])
  onehot = hit.astype(jnp.float32)
  g = g_ref[...]
  # g == 0 (a masked token): exactly 0, even where its logits are NaN / inf. Out-of-range columns are
  # dropped by the store.
  dx_ref[...] = jnp.where(g == 0, 0.0, g * (onehot - p)).astype(dx_ref.dtype)


def fwd(cfg: LossConfig, x, ids, thr=None):
  """(logp, entropy, lse_rel, shift) [N] f32 of logits x [N, V] and ids [N]; thr: [N] f32 support
  thresholds or None."""
  if cfg.blocks.vocab_tiled:  # the heuristic's choice where a [rows, V] block outgrows VMEM
    return pallas_tpu_vocab.fwd(cfg, x, ids, thr)
  n, v = x.shape
  bn = pallas_blocks.stats_rows(cfg.blocks.block_n, n, v, x.dtype, cfg.target, blocks=1)
  chosen = lse.chosen_logit(x, ids, v, cfg.temperature).reshape(n, 1)
  rows = [] if thr is None else [thr.reshape(n, 1)]
  row_spec = pl.BlockSpec((bn, 1), lambda i: (i, 0))
  outs = pl.pallas_call(
    functools.partial(_tiled_fwd_kernel, cfg=cfg, gapped=thr is not None),
    grid=(pl.cdiv(n, bn),),
    in_specs=[pl.BlockSpec((bn, v), lambda i: (i, 0))] + [row_spec] * (1 + len(rows)),
    out_specs=[row_spec] * 4,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * 4,
    compiler_params=backend.compiler_params(
      cfg.target,
      dimension_semantics=("parallel",),
      vmem_limit_bytes=pallas_blocks.row_block_vmem_bytes(bn, v, x.dtype, blocks=1),
    ),
    interpret=cfg.target.interpret,
    name="grpo_loss_fwd",
  )(x, chosen, *rows)
  return tuple(o.reshape(n) for o in outs)


def bwd(cfg: LossConfig, x, ids, lse, shift, g, thr=None):
  """dlogits [N, V] in x's dtype from the saved (lse, shift) and g = d loss / d z_chosen [N]; thr:
  [N] f32 support thresholds (dlogits 0 outside S) or None."""
  n, v = x.shape
  rows = (ids, lse, shift, g) + (() if thr is None else (thr,))
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  tile = pl.BlockSpec((bn, bv), lambda i, j: (i, j))
  row_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  # vocab-tiled: the slab-swept kernel (its tiles are as wide as the statistics kernel's)
  body = pallas_tpu_vocab.bwd_kernel if cfg.blocks.vocab_tiled else _tiled_bwd_kernel
  return pl.pallas_call(
    functools.partial(body, cfg=cfg),
    grid=(pl.cdiv(n, bn), pl.cdiv(v, bv)),
    in_specs=[tile] + [row_spec] * len(rows),
    out_specs=tile,
    out_shape=jax.ShapeDtypeStruct((n, v), x.dtype),
    input_output_aliases={0: 0} if cfg.reuse_logits_buffer else {},
    compiler_params=backend.compiler_params(
      cfg.target, dimension_semantics=("parallel", "parallel")
    ),
    interpret=cfg.target.interpret,
    name="grpo_loss_bwd",
  )(x, *(a.reshape(n, 1) for a in rows))


# ------------------------------------------------------------------------------- training path
def _tiled_train_kernel(ids_ref, x_ref, tok_ref, *refs, cfg, rows_per_step, gapped: bool):
  """Per group of rows (:mod:`kernels.grpo_loss.pallas_tpu_sweeps`): the statistics sweeps, log p, the
  coefficient g, the dlogits sweep, then each row's chosen column; all from the [bn, V] block in
  VMEM. ids_ref: all N ids in SMEM (the chosen columns' addresses); ``gapped``: refs starts with the
  rows' [bn, 1] support thresholds, applied in the exponentials' and the dlogits sweeps."""
  thr_ref, out_refs = (refs[0], refs[1:]) if gapped else (None, refs)
  logp_ref, ent_ref, lse_ref, shift_ref, dx_ref = out_refs
  bn, v = x_ref.shape
  loss = cfg.loss
  sw = sweeps.sweep_of(v, loss.temperature, loss.blocks.block_v, loss.target.interpret, gapped)
  # read at the kernel's top level: the interpreter has no rule for program_id inside its loops
  step_row = pl.program_id(0) * rows_per_step

  def rows_body(rows, size):
    first = step_row + rows.start
    chosen = sweeps.gather_chosen(x_ref, rows, size, first, ids_ref, sw)
    thr = thr_ref[rows, :] if gapped else None
    m, l, s = lse.merge(*sweeps.lane_stats(x_ref, rows, sw, size, thr), axis=1)
    logp, ent, lse_rel, shift = lse.finalize(m, l, s, chosen, 1.0)
    tok = {k: tok_ref[rows, i : i + 1] for i, k in enumerate(cfg.fields)}
    g = coefficient(cfg, logp, tok)
    sweeps.write_grads(x_ref, dx_ref, rows, sw, m, l, g, thr)
    # the chosen column: g * onehot - g * softmax, in the order the sweep's formula had it
    value = jnp.where(g == 0, 0.0, g + (-g / l) * jnp.exp(chosen - m))
    sweeps.patch_chosen(dx_ref, rows, size, first, ids_ref, value, sw)
    for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), (logp, ent, lse_rel, shift)):
      ref[rows, :] = val

  sweeps.for_row_groups(bn, sweeps.row_group(bn, x_ref.dtype), rows_body)


def train_fwd(cfg: TrainConfig, x, ids, tok, thr=None):
  """(logp, entropy, lse_rel, shift [N] f32, dlogits [N, V]) of the training path; thr: [N] f32
  support thresholds or None."""
  if cfg.loss.blocks.vocab_tiled:
    return _vocab_tiled_train(cfg, x, ids, tok, thr)
  n, v = x.shape
  bn = pallas_blocks.stats_rows(cfg.loss.blocks.block_n, n, v, x.dtype, cfg.loss.target, blocks=2)
  # the ids ride in SMEM (scalar prefetch, N x 4 bytes): the chosen columns' addresses
  row_spec = pl.BlockSpec((bn, 1), lambda i, ids: (i, 0))
  block = pl.BlockSpec((bn, v), lambda i, ids: (i, 0))
  rows = [] if thr is None else [thr.reshape(n, 1)]
  grid = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(pl.cdiv(n, bn),),
    in_specs=[block, pl.BlockSpec((bn, tok.shape[1]), lambda i, ids: (i, 0))]
    + [row_spec] * len(rows),
    out_specs=[row_spec] * 4 + [block],
  )
  outs = pl.pallas_call(
    functools.partial(_tiled_train_kernel, cfg=cfg, rows_per_step=bn, gapped=thr is not None),
    grid_spec=grid,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * 4
    + [jax.ShapeDtypeStruct((n, v), x.dtype)],
    # operand 0 is the prefetched ids: the logits are operand 1
    input_output_aliases={1: 4} if cfg.loss.reuse_logits_buffer else {},
    compiler_params=backend.compiler_params(
      cfg.loss.target,
      dimension_semantics=("parallel",),
      vmem_limit_bytes=pallas_blocks.row_block_vmem_bytes(bn, v, x.dtype, blocks=2),
    ),
    interpret=cfg.loss.target.interpret,
    name="grpo_loss_train",
  )(ids, x, tok, *rows)
  return tuple(o.reshape(n) for o in outs[:4]) + (outs[4],)


def _vocab_tiled_train(cfg: TrainConfig, x, ids, tok, thr):
  """The training path where a [rows, V] block outgrows VMEM (``LossBlocks.vocab_tiled``): the
  vocab-tiled statistics (:mod:`kernels.grpo_loss.pallas_tpu_vocab`), the coefficient g on [N]
  in XLA, the tiled backward kernel: two reads of the logits, one write of dlogits."""
  logp, ent, lse_rel, shift = pallas_tpu_vocab.fwd(cfg.loss, x, ids, thr)
  g = coefficient(cfg, logp, {k: tok[:, i] for i, k in enumerate(cfg.fields)})
  return logp, ent, lse_rel, shift, bwd(cfg.loss, x, ids, lse_rel, shift, g, thr)
