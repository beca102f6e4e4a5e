"""The online-softmax step every paged-attention kernel family runs, and the finite mask value every
impl uses for scores past a sequence's length (exp(MASK - m) is 0, never NaN)."""

from __future__ import annotations

import jax.numpy as jnp

# A masked score: finite, so exp(MASK - m) is 0 and never NaN.
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def online_update(q, k, v, valid, valid_kv, m, l, acc, scale):
  """One online-softmax step. q [G, D], k/v [bk, D], valid [G, bk] and valid_kv [bk, 1 or D] bool (the
  same positions; None: every slot is valid, resp. v is already zero there); m/l [G, 1], acc [G, D]
  f32."""
  s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # [G, bk]
  if valid is not None:
    s = jnp.where(valid, s, MASK)
  # Slots past the length may hold a recycled page's stale NaN / inf: p = 0 there, but 0 * NaN = NaN.
  if valid_kv is not None:
    v = jnp.where(valid_kv, v, jnp.zeros((), v.dtype))
  m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new)
  l_new = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
  acc_new = alpha * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, l_new, acc_new


def finish(m, l, acc):
  """(normalised output, log-sum-exp); a split that saw no token gives (0, -inf). A NaN l (scores
  that overflowed, e.g. q = 3e38) stays NaN, as in the reference: never hidden as zeros."""
  empty = l == 0
  out = jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, l))
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  return out, lse
