"""The sampled support: scoring a token over the set the sampler drew it from (truncation-exact log-probs).

A rollout that samples with top-k / top-p / min-p draws a token y from the truncated, renormalised
distribution; scoring y under the full softmax biases the importance ratio by log(kept mass). The
engine therefore returns, per sampled token, its **support gap** (z = logits / temperature)::

    g = t - z_y  <= 0       (-inf: nothing was filtered)

with t any threshold between the largest dropped z and the smallest kept z of the set y was drawn
from (the engines report the midpoint, ``rl.rollout.sampling.gap_of``: on the sampler's own logits S
below is exactly the kept set, and a trainer whose logits round differently keeps the same boundary
tokens; with t = the smallest kept z the boundary token would drop out half the time)

and the trainer, with its own scaled logits z', scores y over S = { v : z'_v >= z'_y + g }::

    log p~(y) = z'_y - logsumexp{ z'_v : v in S }

The gap is relative to z_y, so a constant shift of a row's logits leaves S unchanged, and the same gap
applies to the reference model's logits. y is always in S (also when z'_y + g rounds above z'_y's own
value); outside S a logit is -inf, so softmax, entropy, gradient (1[v = y] - p~_v on S, 0 outside)
and the KL terms all follow from the plain formulas on the gapped logits. Every impl (the XLA
reference, the chunked path, the Pallas / Mosaic kernels' forward and backward sweeps) forms its
gapped logits with :func:`gapped` from a per-row :func:`threshold`, so the rule lives here only;
the TPU sweeps, VALU-bound, use its one-select form on z - m (:func:`gapped_shift`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.lse import LOG_FLOOR, NEG_BIG

__all__ = [
  "apply_gap",
  "chosen_logit",
  "gapped",
  "gapped_shift",
  "sweep_threshold",
  "threshold",
]


def threshold(
  z_chosen,  # [...] f32: the scaled logit of the scored token, z'_y
  gap,  # [...] f32: the support gap g <= 0, -inf where nothing was filtered
):  # -> [...] f32
  """z'_y + g: the smallest scaled logit in the scored set; -inf where g is -inf (no filter).

  Carries no gradient: set membership is a step function of the logits."""
  return jax.lax.stop_gradient(z_chosen.astype(jnp.float32) + gap.astype(jnp.float32))


def gapped(
  z,  # [..., V] f32 scaled logits (or a [rows, cols] tile of them)
  thr,  # [..., 1] f32 threshold (broadcasts over the vocabulary axis)
  hit,  # [..., V] bool: the column is the scored token y (or None: no column is y's)
):  # -> [..., V] f32
  """z where z >= thr or the column is y, -inf elsewhere: the logits of S (module docstring).

  The ``hit`` term keeps y in S whatever the rounding of z'_y + g; ties with the threshold are kept
  (the sampler's threshold rule); a -inf threshold keeps every column, -inf ones included."""
  keep = z >= thr if hit is None else (z >= thr) | hit
  return jnp.where(keep, z, -jnp.inf)


def sweep_threshold(
  thr,  # [...] f32 thresholds z'_y + g (-inf: no filter; NaN: an empty row)
  m,  # [...] f32 the max the sweep's exponentials are taken against (>= z'_y)
):  # -> [...] f32
  """thr - m, as :func:`gapped_shift` compares z - m with it: never below the most negative finite
  f32, so a -inf (or NaN) column falls outside S while every finite one stays in when nothing was
  filtered (:func:`gapped`'s -inf threshold keeps -inf columns too: they add exactly 0 either way)."""
  return jnp.maximum(thr - m, NEG_BIG)


def gapped_shift(
  d,  # [..., V] f32 z - m of a tile's scaled logits against the sweep's max
  thr_rel,  # [..., 1] f32 :func:`sweep_threshold` (or broadcast to d)
):  # -> [..., V] f32
  """d over S, ``lse.LOG_FLOOR`` outside it: the input of a sweep's exponentials that needs no
  clamp of its own (exp of it is 0 and p * it is 0, never 0 * -inf). One compare and one select
  per element, in place of :func:`gapped`'s compare and select plus the sweep's -inf clamp: what a
  VALU-bound TPU sweep pays for the gap (its z - m is computed anyway; comparing z itself keeps two
  values live per element and spilled in libtpu's schedule).

  The rule of :func:`gapped` on z - m and thr - m, each rounded once: ties are kept and y stays in
  S (rounding is monotone and thr <= z_y when thr is formed from the kernel's own z_y, as
  :func:`threshold` of the same f32 product is); a column within one rounding of thr - m below it
  may be kept, where the engines' midpoint thresholds never put one. A NaN thr_rel empties the row."""
  return jnp.where(d >= thr_rel, d, LOG_FLOOR)


def chosen_logit(
  z,  # [..., V] f32 scaled logits
  ids,  # [...] int: the scored token; outside [0, V) gives NaN
):  # -> [...] f32
  """z[..., id], NaN for an id outside [0, V) (never a wrapped-around column)."""
  inside = (ids >= 0) & (ids < z.shape[-1])
  picked = jnp.take_along_axis(z, jnp.where(inside, ids, 0)[..., None], axis=-1)[..., 0]
  return jnp.where(inside, picked, jnp.nan)


def apply_gap(
  z,  # [..., V] f32 scaled logits
  ids,  # [...] int: the scored tokens
  gap,  # [...] f32 support gaps, or None
):  # -> [..., V] f32
  """The gapped logits of whole rows (the XLA paths); ``gap=None``: z unchanged."""
  if gap is None:
    return z
  hit = jnp.arange(z.shape[-1]) == ids[..., None]
  return gapped(z, threshold(chosen_logit(z, ids), gap)[..., None], hit)
