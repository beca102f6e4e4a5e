"""The vocab-tiled statistics kernel of the tiled (TPU) family: any vocabulary on any generation.

The whole-row kernels (:mod:`kernels.grpo_loss.pallas_tpu`) hold [rows, V] blocks in VMEM; at f32
V = 151936 the training kernel's 8-row block (in and dlogits out, double-buffered) needs 22.5 MiB,
over v4's 16 MiB. When :func:`kernels.grpo_loss.pallas_blocks.default_blocks` says the row block does
not fit (``LossBlocks.vocab_tiled``), the statistics run here instead:

grid (rows / bn, V / bv), rows ``parallel``, vocabulary ``arbitrary``: each [bn, bv] tile is swept by
the whole-row kernels' register-sized sweeps (:func:`kernels.grpo_loss.pallas_tpu_sweeps.lane_stats`,
whose width is the tile's: the last tile's is the vocabulary's remainder, static, so its columns past
V are never read as logits), its lane partials merged per row, and folded into the rows' running
(max, sum exp, sum exp * z) kept in VMEM scratch across the vocabulary axis; the last tile finishes
them into (log p, entropy, lse_rel, shift). The sweeps' windows are unpacked to f32 before they
are split into slabs (``Sweep.unpack``): this kernel's chips (v4, an unnamed generation) have no
bf16 VPU, and libtpu compiles a bf16 slab stack on v4 into four sublane rotations a vreg. The
chosen logits are gathered outside (N elements), as the whole-row forward does; with a support gap the rows' thresholds ride in one more [N, 1] input
and every tile's exponentials are gapped (:func:`kernels.grpo_loss.pallas_tpu_sweeps.lane_stats`).
The training path is this pass, the in-XLA coefficient on [N] and the
(rows, V)-tiled backward kernel: two reads of the logits and one write of dlogits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import backend, lse
from kernels.grpo_loss import pallas_tpu_sweeps as sweeps
from kernels.grpo_loss.pallas_blocks import LossConfig


def _combine(a, b):
  """Two rows' partial statistics (m, l, s), [G, 1] each, as one (:func:`kernels.lse.merge` of
  two parts without building a [G, 2] array: a part with m = NEG_BIG has weight 0)."""
  (m1, l1, s1), (m2, l2, s2) = a, b
  top = jnp.maximum(m1, m2)
  w1, w2 = jnp.exp(m1 - top), jnp.exp(m2 - top)
  part = lambda w, m, l, s: jnp.where(w == 0, 0.0, w * (s + (m - top) * l))
  return top, w1 * l1 + w2 * l2, part(w1, m1, l1, s1) + part(w2, m2, l2, s2)


def _stats_kernel(x_ref, chosen_ref, *refs, cfg, steps, rem, gapped: bool):
  """One [bn, bv] tile folded into the rows' running statistics (scratch: m, l, s [bn, 1] f32);
  ``steps`` tiles per row, the last ``rem`` columns wide (static); ``gapped``: refs starts with the
  rows' [bn, 1] support thresholds, applied to every tile's exponentials."""
  thr_ref, refs = (refs[0], refs[1:]) if gapped else (None, refs)
  (logp_ref, ent_ref, lse_ref, shift_ref), scratch = refs[:4], refs[4:]
  j = pl.program_id(1)  # at the kernel's top level: the interpreter has no rule for it in loops
  bn, bv = x_ref.shape
  group = sweeps.row_group(bn, x_ref.dtype)

  @pl.when(j == 0)
  def _():
    scratch[0][...] = jnp.full((bn, 1), lse.NEG_BIG, jnp.float32)
    scratch[1][...] = jnp.zeros((bn, 1), jnp.float32)
    scratch[2][...] = jnp.zeros((bn, 1), jnp.float32)

  def fold(width):
    sw = sweeps.sweep_of(
      width, cfg.temperature, cfg.blocks.block_v, cfg.target.interpret, gapped, unpack=True
    )

    def rows_body(rows, size):
      thr = thr_ref[rows, :] if gapped else None
      tile = lse.merge(*sweeps.lane_stats(x_ref, rows, sw, size, thr), axis=1)
      new = _combine(tuple(r[rows, :] for r in scratch), tile)
      for r, val in zip(scratch, new):
        r[rows, :] = val

    sweeps.for_row_groups(bn, group, rows_body)

  if rem == bv:
    fold(bv)
  else:  # the last tile: only its first ``rem`` columns are the vocabulary's
    pl.when(j < steps - 1)(lambda: fold(bv))
    pl.when(j == steps - 1)(lambda: fold(rem))

  @pl.when(j == steps - 1)
  def _():
    def rows_body(rows, size):
      m, l, s = (r[rows, :] for r in scratch)
      stats = lse.finalize(m, l, s, chosen_ref[rows, :], 1.0)
      for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), stats):
        ref[rows, :] = val

    sweeps.for_row_groups(bn, group, rows_body)


def fwd(cfg: LossConfig, x, ids, thr=None):
  """(logp, entropy, lse_rel, shift) [N] f32 of logits x [N, V] and ids [N]; thr: [N] f32 support
  thresholds or None."""
  n, v = x.shape
  bn, bv = min(cfg.blocks.block_n, n), min(cfg.blocks.block_v, v)
  steps = pl.cdiv(v, bv)
  chosen = lse.chosen_logit(x, ids, v, cfg.temperature).reshape(n, 1)
  rows = [] if thr is None else [thr.reshape(n, 1)]
  row_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  kernel = functools.partial(
    _stats_kernel, cfg=cfg, steps=steps, rem=v - (steps - 1) * bv, gapped=thr is not None
  )
  outs = pl.pallas_call(
    kernel,
    grid=(pl.cdiv(n, bn), steps),
    in_specs=[pl.BlockSpec((bn, bv), lambda i, j: (i, j))] + [row_spec] * (1 + len(rows)),
    out_specs=[row_spec] * 4,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * 4,
    scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32)] * 3,
    compiler_params=backend.compiler_params(
      cfg.target, dimension_semantics=("parallel", "arbitrary")
    ),
    interpret=cfg.target.interpret,
    name="grpo_loss_fwd_vocab",
  )(x, chosen, *rows)
  return tuple(o.reshape(n) for o in outs)
