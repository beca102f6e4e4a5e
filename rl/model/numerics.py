"""Batch-invariant numerics (`ModelConfig.batch_invariant`): the same bits for a token whether the
decoder runs it in a [B, 1] decode step through a cache or in a [B, T] teacher-forced forward.

Four things make a bf16 forward depend on the shape it runs at, each measured on XLA:CPU
(bench.mismatch; docs/rollout.md):

- **Reductions.** XLA picks a reduction's order (and its vectorisation) per shape, so the softmax's
  and the RMSNorm's sums differ in their last f32 bits between a 1-query and a 48-query program; one
  such bit in a hundred flips a bf16 rounding. `pairwise_sum` fixes the order: adjacent pairs first,
  then pairs of pairs, over the axis zero-padded to a power of two. A row's result then depends on
  that row alone, and on no number of zeros after its last element (a masked attention tail).
- **Excess precision.** XLA may keep a bf16 value in f32 where it fuses its producer with its
  consumer, and it fuses a decode step and a teacher-forced forward differently.
  `round_to` rounds with `lax.reduce_precision`, which XLA keeps (a convert pair it may drop), so
  every bf16 value is rounded where the model says, in every program.
- **Matmul kernels.** XLA:CPU picks a matmul's kernel by shape: a one-row product runs as a
  matrix-vector kernel that sums in another order than the matrix-matrix kernel of many rows, and an
  f32 x f32 product's order changed with the row count in every layout tried. The projections and
  q @ k take bf16 operands with f32 results (`preferred_element_type`; the same bits at every row
  count of two or more that was tried), a single row is computed as two, and p @ v (which XLA:CPU
  cannot run in bf16 -> f32 where it does not fuse it) is formed as products summed by
  `pairwise_sum`.
- **Where a key sits.** The trainer's rows are [left-padded prompt | completion] and a cache holds
  a sequence from slot 0, so the same keys would sit at other columns and the pairwise sums would
  pair other terms: the teacher-forced forward (`Qwen.__call__`) moves each row's real tokens to its
  front, and its states back.

This is measured, not promised: tests/rl/model/test_numerics.py pins the presets and shapes where
the whole decoder is bitwise batch-invariant on XLA:CPU (jax 0.10 and 0.11). Accelerator kernels
(MXU, Pallas) choose their own orders and are not covered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def pairwise_sum(x: Array) -> Array:  # [..., n] -> [...]
  """The sum over the last axis in a fixed order: adjacent pairs, then pairs of those, ... over the
  axis zero-padded at its end to a power of two. Its bits depend on a row's values alone: not on how
  many rows are summed at once, nor on how many zeros follow the row's last element."""
  n = x.shape[-1]
  width = 1 << max(n - 1, 0).bit_length()
  if width != n:
    x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], width - n), x.dtype)], axis=-1)
  while x.shape[-1] > 1:
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x = pairs[..., 0] + pairs[..., 1]
  return x[..., 0]


def round_to(x: Array, dtype) -> Array:  # [...] f32 -> [...] dtype
  """`x` rounded to `dtype` (round to nearest even), in every program that computes it: XLA may drop
  an f32 -> bf16 -> f32 convert pair inside a fusion, never a reduce_precision."""
  dtype = jnp.dtype(dtype)
  info, source = jnp.finfo(dtype), jnp.finfo(x.dtype)
  if info.nexp >= source.nexp and info.nmant >= source.nmant:  # a widening: exact, nothing rounds
    return x.astype(dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(
    dtype
  )


def param(w: Array, dtype) -> Array:  # [...] stored -> [...] f32 holding `dtype`'s values
  """A parameter as the compute dtype rounds it, widened back to f32 for an f32 computation (the
  rounding kept: a plain cast pair is one XLA may drop)."""
  return round_to(w.astype(jnp.float32), dtype).astype(jnp.float32)


def softmax(scores: Array) -> Array:  # [..., S] f32 -> [..., S] f32
  """Softmax over the last axis with `pairwise_sum` for its denominator (the max is exact in any
  order; a masked score's exponential is an exact 0, so a longer masked tail changes nothing)."""
  e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  return e / pairwise_sum(e)[..., None]


def linear(
  x: Array,  # [..., din] compute dtype
  kernel: Array,  # [din, dout]
  bias: Array | None,  # [dout] or None
) -> Array:  # [..., dout] in x's dtype
  """x @ kernel (+ bias) with f32 accumulation, the bias added in f32, rounded once. One row is
  computed as two: XLA:CPU runs a one-row product as a matrix-vector kernel, which sums in another
  order than the matrix-matrix kernel a batch of rows gets."""
  rows = x.reshape(-1, x.shape[-1])  # [N, din]
  n = rows.shape[0]
  if n == 1:
    rows = jnp.concatenate([rows, rows])
  y = jnp.dot(rows, kernel.astype(x.dtype), preferred_element_type=jnp.float32)[:n]
  y = y.reshape(*x.shape[:-1], y.shape[-1])
  if bias is not None:
    y = y + param(bias, x.dtype)
  return round_to(y, x.dtype)


def add(a: Array, b: Array) -> Array:  # [...] x2, one dtype -> [...] rounded once
  """a + b in f32, rounded to their dtype (a residual connection)."""
  return round_to(a.astype(jnp.float32) + b.astype(jnp.float32), a.dtype)
