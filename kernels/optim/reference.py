"""The element-wise AdamW and Lion updates, in optax's exact operation order.

These are the definitions the Pallas kernels evaluate tile by tile (the kernels only change how the
bytes move); the tests check the whole thing against ``optax.adamw`` / ``optax.lion`` themselves.
All arguments are f32 arrays of one shape (or broadcastable scalars); returns f32.
"""

from __future__ import annotations

import jax.numpy as jnp


def bias_corrections(count, b1: float, b2: float):
  """optax's 1 - b ** (count + 1), in f32, for the step being taken (``count`` = steps done)."""
  count_inc = (count + 1).astype(jnp.int32)
  return 1 - b1 ** count_inc.astype(jnp.float32), 1 - b2 ** count_inc.astype(jnp.float32)


def adamw_delta(p, g, mu, nu, lr, bc1, bc2, *, b1, b2, eps, weight_decay):
  """(delta, mu', nu'): scale_by_adam -> add_decayed_weights -> scale_by_learning_rate."""
  mu = (1 - b1) * g + b1 * mu
  nu = (1 - b2) * (g * g) + b2 * nu
  u = (mu / bc1) / (jnp.sqrt(nu / bc2) + eps)
  if weight_decay:
    u = u + weight_decay * p
  return (-lr) * u, mu, nu


def lion_delta(p, g, mu, lr, *, b1, b2, weight_decay):
  """(delta, mu'): scale_by_lion -> add_decayed_weights -> scale_by_learning_rate."""
  u = _sign((1 - b1) * g + b1 * mu)
  mu = (1 - b2) * g + b2 * mu
  if weight_decay:
    u = u + weight_decay * p
  return (-lr) * u, mu


def _sign(x):
  """jnp.sign, written with selects: Mosaic's sign lowering needs a TPU to query, and this lowers
  ahead of time from any host. NaN stays NaN (x * 0), as with jnp.sign."""
  return jnp.where(x > 0, 1.0, jnp.where(x < 0, -1.0, x * 0.0))
