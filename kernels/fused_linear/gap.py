"""The sampled support in the fused LM-head paths (:mod:`kernels.support`: the rule lives there).

The fused kernels never hold a whole row of logits, so the threshold t = z'_y + g of each row is
formed before their sweeps, in XLA, from the chosen token's column of the head alone (an [N, H]
gather, cheap next to N·H·V), and every logits tile of every sweep applies :func:`support.gapped`
with it (``hit``: the column is the row's id). z'_y here and the tile's own value of it may differ
by rounding (another summation order over H): ``hit`` keeps y in S whatever t is, and the rounding
of t moves only columns tied with the boundary to within that rounding, which the reference's own
rounding moves alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import support


def thresholds(
  h,  # [N, H] hidden rows (masked rows zeroed)
  w,  # [H, V] the whole head (every vocabulary shard: the id's column may be on any)
  ids,  # [N] int: global ids
  gap,  # [N] f32 support gaps (<= 0; -inf: nothing filtered)
  temperature: float,
):  # -> [N] f32
  """t = z'_y + g per row, z'_y = h[n] . w[:, y_n] / temperature in f32 (no gradient). An id
  outside [0, V) gathers column 0: its row's log-prob is NaN whatever t is (the kernels' ``found``)."""
  safe = jnp.clip(ids, 0, w.shape[1] - 1)
  # [N, H]: the chosen columns as rows of w.T. An untied head [H, V] costs XLA one transpose of it
  # (libtpu models ~1 ms at 3B-8k on v6e, most of a gapped call's extra time); a head that is a tied
  # embedding's transpose ([V, H] in memory) makes this a plain row gather.
  rows = jnp.take(w.T, safe, axis=0)
  z_y = jnp.einsum("nh,nh->n", h, rows, preferred_element_type=jnp.float32) * (1.0 / temperature)
  return support.threshold(z_y, gap)


def keep_raw(
  logits,  # [c, V] f32 raw logits (not yet divided by the temperature) of one chunk
  ids,  # [c] int: shard-local ids (another shard's: no column is y)
  thr,  # [c] f32 thresholds (:func:`thresholds`)
  temperature: float,
):  # -> [c, V] f32
  """The chunked path's logits with -inf outside S, still raw: the softmax kernels it feeds divide
  by the temperature themselves; S is decided on the scaled logits (:func:`support.gapped`)."""
  col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  z = support.gapped(logits * (1.0 / temperature), thr[:, None], col == ids[:, None])
  return jnp.where(jnp.isneginf(z), -jnp.inf, logits)
