"""The vocab-tiled kernels of the tiled (TPU) family: any vocabulary on any generation.

The whole-row kernels (:mod:`kernels.grpo_loss.pallas_tpu`) hold [rows, V] blocks in VMEM; at f32
V = 151936 the training kernel's 8-row block (in and dlogits out, double-buffered) needs 22.5 MiB,
over v4's 16 MiB. When :func:`kernels.grpo_loss.pallas_blocks.default_blocks` says the row block does
not fit (``LossBlocks.vocab_tiled``), the statistics run here instead, on a grid (rows / bn, V / bv),
rows ``parallel``, vocabulary ``arbitrary``, and the training path is these statistics, the
coefficient g on [N] in XLA and :func:`bwd_kernel` over (rows, V)-tiles: two reads of the logits and
one write of dlogits.

**One sweep, against the chosen logit.** v4 has two VALU slots a bundle and no bf16 VPU, so the
statistics are VALU-bound: the max sweep then the exponentials' (the whole-row kernels' form: unpack,
max, unpack, subtract, the exponential's scale, clamp, product, two sums per element) scheduled at 1.8x
one read of bf16 logits at V = 262144. Here each row's sums are taken against its chosen logit z_y
(gathered outside, N elements), known before the sweep: l = sum exp(z - z_y), s = sum exp(z - z_y)
(z - z_y), no max, one unpack (:func:`kernels.grpo_loss.pallas_tpu_sweeps.lane_sums`), and logp = -log l. A term overflows only where
a logit is ~88 nats above z_y, i.e. p_y < 1e-30, which real runs' sampled tokens never are; the
kernel flags such rows (sums outside [:data:`SUM_FLOOR`, :data:`SUM_LIMIT`], inf or NaN: +inf /
NaN logits too), and :func:`fwd` then reruns the exact two-sweep kernel (the running (max, sum, sum)
of each tile's :func:`kernels.grpo_loss.pallas_tpu_sweeps.lane_stats`, merged across tiles) under a
``lax.cond`` and takes its values for the flagged rows, so every input gets the reference's answer
and ordinary ones pay one sweep. The compiled report charges that kernel 0 runs and says so
(:mod:`bench.tpu.hlo_loops`): a best case, for batches with no flagged row. -inf logits (a masked
vocabulary) stay on the one-sweep path: the product's clamp at LOG_FLOOR. The entropy, log l - s / l,
is then taken against z_y rather than the max: its absolute error grows with -logp (about 6e-6 at
logp = -25 against 1.5e-7 in the exact kernel; the log-prob and gradient are unaffected).

The sweeps' windows are unpacked to f32 before they are split into slabs (``Sweep.unpack``): libtpu
compiles a bf16 slab stack on v4 into four sublane rotations a vreg. The last tile's sweep is its
remainder's width (static), so its columns past V are never read as logits. With a support gap the
rows' thresholds ride in one more [N, 1] input and every tile's exponentials are gapped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import backend, lse, support
from kernels.grpo_loss import pallas_tpu_sweeps as sweeps
from kernels.grpo_loss.pallas_blocks import LossConfig

# A row whose relative sums pass this is redone exactly (:func:`fwd`): finite sums of terms each at
# most e^88 stay below it unless a logit is ~69 nats above the chosen one's (p_y < 1e-30).
SUM_LIMIT = 1e30
# l >= 1 whenever the chosen logit is finite (its own term is exp(0)); a smaller l is a row whose
# reference is 0 (:func:`_reference`) with every logit ~69 nats below it: l underflows, so redo it
SUM_FLOOR = 1e-30
# The sweeps' shape here, read off libtpu 0.0.42.1's v4 schedule of bf16 V = 262144 (bundles per
# 16384 columns of 16 rows): 2 slabs a fold and 16384 columns a loop trip in 65536-column tiles,
# 1110. In 16384-column tiles (the per-tile merge and the loop's ramp 4x as often): 1378 (479 spill
# reloads), 8192 columns a trip 1317, the whole-row kernels' 4-slab folds 1507 (493). Without the
# LOG_FLOOR clamp, 993.
PER_FOLD = 2
COLUMNS_PER_TRIP = 16384


def _sweep(width: int, cfg: LossConfig, gapped: bool) -> sweeps.Sweep:
  """A [rows, width] tile's sweep: unpacked to f32 first (v4, this kernel's chip, has no bf16 VPU)."""
  sw = sweeps.sweep_of(width, cfg.temperature, COLUMNS_PER_TRIP, cfg.target.interpret, unpack=True)
  if sw.whole_rows:
    return sw
  per_fold = min(PER_FOLD, sw.per_fold)
  unroll = max(1, COLUMNS_PER_TRIP // (per_fold * sw.lanes)) * (
    sweeps.GAPPED_UNROLL if gapped else 1
  )
  return dataclasses.replace(sw, per_fold=per_fold, unroll=unroll)


def _combine(a, b):
  """Two rows' partial statistics (m, l, s), [G, 1] each, as one (:func:`kernels.lse.merge` of
  two parts without building a [G, 2] array: a part with m = NEG_BIG has weight 0)."""
  (m1, l1, s1), (m2, l2, s2) = a, b
  top = jnp.maximum(m1, m2)
  w1, w2 = jnp.exp(m1 - top), jnp.exp(m2 - top)
  part = lambda w, m, l, s: jnp.where(w == 0, 0.0, w * (s + (m - top) * l))
  return top, w1 * l1 + w2 * l2, part(w1, m1, l1, s1) + part(w2, m2, l2, s2)


def _reference(chosen):
  """The one-sweep sums' reference per row ([G, 1]): the chosen logit, 0 where it is not finite (an
  id outside [0, V), e.g. an ignore-index padding row: NaN; a -inf logit): those rows' log-probs are
  NaN / -inf from the chosen logit itself, and their sums stay on the one-sweep path unless a
  logit passes ~88 (or all fall ~69 below 0: :data:`SUM_FLOOR`)."""
  return jnp.where(jnp.abs(chosen) < jnp.inf, chosen, 0.0)


def _stats_kernel(x_ref, chosen_ref, *refs, cfg, steps, rem, gapped: bool, exact: bool):
  """One [bn, bv] tile folded into the rows' running statistics; ``steps`` tiles per row, the last
  ``rem`` columns wide (static); ``gapped``: refs starts with the rows' [bn, 1] support thresholds.

  ``exact``: scratch (m, l, s), the max sweep then the exponentials (any finite logits). Else the
  one-sweep form against the chosen logit (:func:`kernels.grpo_loss.pallas_tpu_sweeps.lane_sums`, scratch (l, s)), and a fifth
  output flags the rows whose sums are not trustworthy (overflow, inf or NaN)."""
  thr_ref, refs = (refs[0], refs[1:]) if gapped else (None, refs)
  outs, scratch = (refs[:4], refs[4:]) if exact else (refs[:5], refs[5:])
  j = pl.program_id(1)  # at the kernel's top level: the interpreter has no rule for it in loops
  bn, bv = x_ref.shape
  group = sweeps.row_group(bn, x_ref.dtype)

  @pl.when(j == 0)
  def _():
    for r, val in zip(scratch, ([lse.NEG_BIG] if exact else []) + [0.0, 0.0]):
      r[...] = jnp.full((bn, 1), val, jnp.float32)

  def fold(width):
    if exact:
      sw = sweeps.sweep_of(
        width, cfg.temperature, COLUMNS_PER_TRIP, cfg.target.interpret, gapped, unpack=True
      )
    else:
      sw = _sweep(width, cfg, gapped)

    def rows_body(rows, size):
      thr = thr_ref[rows, :] if gapped else None
      if exact:
        tile = lse.merge(*sweeps.lane_stats(x_ref, rows, sw, size, thr), axis=1)
        new = _combine(tuple(r[rows, :] for r in scratch), tile)
      else:
        # no max sweep: exp(z - z_y) overflows only ~88 nats above z_y, which the flag catches
        sums = sweeps.lane_sums(x_ref, rows, sw, size, _reference(chosen_ref[rows, :]), thr)
        new = [r[rows, :] + jnp.sum(t, axis=1, keepdims=True) for r, t in zip(scratch, sums)]
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
      chosen = chosen_ref[rows, :]
      if exact:
        m, l, s = (r[rows, :] for r in scratch)
      else:  # a NaN sum fails both comparisons: flagged
        m, (l, s) = _reference(chosen), (r[rows, :] for r in scratch)
        ok = (l >= SUM_FLOOR) & (l <= SUM_LIMIT) & (jnp.abs(s) <= SUM_LIMIT)
        outs[4][rows, :] = jnp.where(ok, 0.0, 1.0)
      for ref, val in zip(outs, lse.finalize(m, l, s, chosen, 1.0)):
        ref[rows, :] = val

    sweeps.for_row_groups(bn, group, rows_body)


def fwd(cfg: LossConfig, x, ids, thr=None):
  """(logp, entropy, lse_rel, shift) [N] f32 of logits x [N, V] and ids [N]; thr: [N] f32 support
  thresholds or None. The one-sweep kernel first; the exact two-sweep kernel only when it flags a
  row (a logit ~69 nats above the chosen one's, +inf or NaN logits)."""
  n = x.shape[0]
  chosen = lse.chosen_logit(x, ids, x.shape[1], cfg.temperature).reshape(n, 1)
  rows = [] if thr is None else [thr.reshape(n, 1)]
  *stats, flags = _stats_call(cfg, x, chosen, rows, exact=False)
  flagged = flags > 0

  def exact():  # the flagged rows only: a row's values never depend on the other rows'
    redone = _stats_call(cfg, x, chosen, rows, exact=True)
    return tuple(jnp.where(flagged, e, f) for e, f in zip(redone, stats))

  outs = jax.lax.cond(jnp.any(flagged), exact, lambda: tuple(stats))
  return tuple(o.reshape(n) for o in outs)


def _stats_call(cfg: LossConfig, x, chosen, rows, exact: bool):
  n, v = x.shape
  bn, bv = min(cfg.blocks.block_n, n), min(cfg.blocks.block_v, v)
  steps = pl.cdiv(v, bv)
  row_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  kernel = functools.partial(
    _stats_kernel, cfg=cfg, steps=steps, rem=v - (steps - 1) * bv, gapped=bool(rows), exact=exact
  )
  outs = 4 if exact else 5
  return pl.pallas_call(
    kernel,
    grid=(pl.cdiv(n, bn), steps),
    in_specs=[pl.BlockSpec((bn, bv), lambda i, j: (i, j))] + [row_spec] * (1 + len(rows)),
    out_specs=[row_spec] * outs,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * outs,
    scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32)] * (3 if exact else 2),
    compiler_params=backend.compiler_params(
      cfg.target, dimension_semantics=("parallel", "arbitrary")
    ),
    interpret=cfg.target.interpret,
    # the model (bench.tpu.hlo_loops) charges a conditional's *_fallback kernels as not run
    name="grpo_loss_fwd_vocab_fallback" if exact else "grpo_loss_fwd_vocab",
  )(x, chosen, *rows)


def bwd_kernel(x_ref, ids_ref, lse_ref, shift_ref, g_ref, *refs, cfg: LossConfig):
  """One [bn, bv] tile of dlogits (``pallas_tpu.bwd``'s grid), the whole-tile kernel's formula
  swept in register-sized slabs: row groups x :data:`PER_FOLD` slabs, each stored as it is done.
  Why: the whole-tile form holds [bn, bv] f32 temporaries (v4, 16 x 16384 bf16: 2442 bundles a
  step, 1613 spill reloads, and its VMEM bars wider tiles). refs: ([thr_ref,] dx_ref)."""
  thr_ref, dx_ref = (refs[0] if len(refs) == 2 else None), refs[-1]
  bn, bv = x_ref.shape
  sw = _sweep(bv, cfg, thr_ref is not None)
  base = pl.program_id(1) * bv  # at the kernel's top level: the interpreter has no rule in loops

  def rows_body(rows, size):
    ids, shift, lse_rel, g = (r[rows, :] for r in (ids_ref, shift_ref, lse_ref, g_ref))
    thr = None if thr_ref is None else thr_ref[rows, :]
    lane = jax.lax.broadcasted_iota(jnp.int32, (size, sw.lanes), 1)

    def block(first, z):  # z: [count, G, width] scaled logits of the columns from ``first``
      out = []
      for s in range(z.shape[0]):
        hit = lane[:, : z.shape[2]] == ids - (base + first + s * sw.lanes)
        zs = z[s] if thr is None else support.gapped(z[s], thr, hit)
        p = jnp.exp((zs - shift) - lse_rel)
        # g == 0 (a masked token): exactly 0, even where its logits are NaN / inf
        out.append(jnp.where(g == 0, 0.0, g * (hit.astype(jnp.float32) - p)))
      out = jnp.concatenate(out, axis=1) if len(out) > 1 else out[0]
      dx_ref[rows, pl.ds(first, out.shape[1])] = out.astype(dx_ref.dtype)

    sweeps.sweep_blocks(x_ref, rows, sw, block)

  sweeps.for_row_groups(bn, sweeps.row_group(bn, x_ref.dtype), rows_body)
