"""Pieces shared by the loss kernels (``grpo_loss`` and ``fused_linear_grpo_loss``): the online
log-sum-exp statistics over vocabulary tiles, its finite -inf, the large-max shift rule, a row's
finished statistics and chosen logit (every kernel family's), and the block legality rules of each
target."""

from __future__ import annotations

import jax.numpy as jnp

# The running max starts at the most negative finite f32, not -inf: a tile of -inf logits (a top-k
# mask) then gives exp(-inf - m) = 0, never exp(-inf + inf) = NaN, and any finite logit (even -3e38)
# raises it. The rescale term guards alpha == 0 itself (see online_step).
NEG_BIG = -float(jnp.finfo(jnp.float32).max)

# Rows whose max logit reaches this magnitude keep log-sum-exp relative to the max: at |m| ~ 3e38,
# m + log(l) rounds log(l) away (log 5 is far below one ulp), so logp and the softmax would be off by
# log(l). Below it the shift is 0 and every result is bit for bit the plain lse formula.
SHIFT_AT = float(2**20)


def lse_shift(m):
  """The shift of a row whose running max is m: 0 below SHIFT_AT, else m (see SHIFT_AT)."""
  return jnp.where(jnp.abs(m) < SHIFT_AT, 0.0, m)


# exp(LOG_FLOOR) is 0 in f32 (e^-128 < 2^-149 / 2): clamping z - m there changes no p, and makes a
# -inf (masked) column give p = 0 and p * (z - m) = 0 * LOG_FLOOR = 0, not 0 * -inf = NaN.
LOG_FLOOR = -128.0


def online_step(z, valid, m, l, s, *, rmax, rsum, expand=lambda x: x):
  """The one online log-sum-exp step every loss kernel folds a tile with: (m, l, s, p) after tile z.

  z: scaled logits (invalid columns already -inf); m: running max; l: sum exp(z - m); s: sum
  p * (z - m) (the entropy's term). How a tile reduces and broadcasts is the caller's layout:
  rmax / rsum reduce the tile's vocabulary axis (identity rsum: per-lane sums; the TPU sweeps reduce
  a stack of slabs over its leading axis), expand broadcasts a reduced max back over the tile. p is
  the tile's exp(z - m_new), for callers that store it. ``rmax=None``: m is already at least z's
  max (a sweep that took the max first), so nothing is rescaled. ``valid`` is not read: invalid columns are
  -inf in z, which the LOG_FLOOR clamp already sends to p = 0 and p * (z - m) = 0 (one max per
  element instead of two selects and a compare); callers may pass None.
  """
  del valid
  if rmax is None:  # m is z's max already (a two-pass sweep): nothing to rescale
    m_new = m
  else:
    m_new = jnp.maximum(m, rmax(z))
  # 0 * log 0 = 0: below LOG_FLOOR p is 0 and the term 0 * LOG_FLOOR (a NaN z stays NaN: maximum
  # propagates it)
  d = z - expand(m_new)
  p = jnp.exp(d)
  zc = jnp.maximum(d, LOG_FLOOR)  # clamped for the product only: exp(d) is 0 below it anyway
  if rmax is None:
    return m_new, l + rsum(p), s + rsum(p * zc), p
  alpha = jnp.exp(m - m_new)
  # when alpha underflows (a max jump past ~88, e.g. from -3e38 to 3e38) the old terms vanish
  # instead of forming 0 * -inf
  s = jnp.where(alpha == 0, 0.0, alpha * (s + (m - m_new) * l)) + rsum(p * zc)
  l = alpha * l + rsum(p)
  return m_new, l, s, p


def merge(m, l, s, axis):
  """Merge partial statistics (m, l, s as from :func:`online_step`) along ``axis`` (keepdims): the
  lanes of a row (TPU sweeps) or the splits of one (the rowloop split kernel). A part that saw no
  column (m = NEG_BIG) has weight exp(m - top) = 0 and its terms are dropped."""
  top = jnp.max(m, axis=axis, keepdims=True)
  a = jnp.exp(m - top)
  l_all = jnp.sum(a * l, axis=axis, keepdims=True)
  s_all = jnp.sum(jnp.where(a == 0, 0.0, a * (s + (m - top) * l)), axis=axis, keepdims=True)
  return top, l_all, s_all


def row_reductions(expand):
  """online_step's reductions for [rows, cols] tiles in a Mosaic GPU register layout, where a
  reduced row vector is broadcast back by `expand` (no keepdims there)."""
  return dict(rmax=lambda x: x.max(axis=1), rsum=lambda x: x.sum(axis=1), expand=expand)


def online_update(z, hit, valid, m, l, s, chosen, found, axis):
  """Fold one tile of scaled logits z (invalid columns already -inf) into the running statistics.

  m: running max; l: sum exp(z - m); s: sum p * (z - m) (the entropy's term); chosen: the chosen
  token's z; found: how many columns matched the id (0: the id is outside this vocabulary).
  axis: the tile's vocabulary axis (1 for [rows, cols] tiles), or None for a 1-D chunk of one row.
  """
  # an id in the tail tile's padding columns (>= V) is not found: NaN, as any id >= V
  hit = hit & valid
  keep = axis is not None
  rsum = lambda x: jnp.sum(x, axis=axis, keepdims=keep)
  rmax = lambda x: jnp.max(x, axis=axis, keepdims=keep)
  m_new, l, s, _ = online_step(z, valid, m, l, s, rmax=rmax, rsum=rsum)
  chosen = chosen + rsum(jnp.where(hit, z, 0.0))
  found = found + rsum(hit.astype(jnp.float32))
  return m_new, l, s, chosen, found


# ------------------------------------------------------------------------------ block legality
def is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def check_tpu_tile(name: str, block: int, full: int, multiple: int, dim: str) -> None:
  """Mosaic's (8, 128) rule: a block's last two dims are multiples of (8, 128) or span the array."""
  if block % multiple and block != full:
    raise ValueError(
      f"TPU {name} must be a multiple of {multiple} or equal {dim}={full}, got {block}"
    )


def check_triton_tile(name: str, block: int) -> None:
  if not is_pow2(block):
    raise ValueError(f"Triton tiles must be powers of two: {name}={block}")


def lane_update(z, valid, m, l, s):
  """Fold one 1-D chunk of scaled logits z (invalid columns -inf) into per-lane statistics.

  The rowloop kernels' online update: m is the row's running max (a scalar, one block-wide reduction
  per chunk), l and s are per-lane vectors (sum exp(z - m) and sum p * (z - m), all lanes relative to
  the same m) reduced across the program once per row, not once per chunk — a chunk costs one
  cross-warp reduction instead of five. Same guards as :func:`online_step`.
  """
  m_new, l, s, _ = online_step(z, valid, m, l, s, rmax=jnp.max, rsum=lambda x: x)
  return m_new, l, s


def finalize(m, l, s, chosen, found):
  """(logp, entropy, lse_rel, shift) of rows' statistics: the log-sum-exp is shift + lse_rel."""
  shift = lse_shift(m)
  lse_rel = (m - shift) + jnp.log(l)
  entropy = jnp.log(l) - s / l
  # an id outside [0, V) poisons, never hides
  logp = jnp.where(found > 0, (chosen - shift) - lse_rel, jnp.nan)
  return logp, entropy, lse_rel, shift


def chosen_logit(x, ids, vocab: int, temperature: float):
  """z at each row's id, [N] f32 (NaN where the id is outside [0, V): it poisons, never hides).

  x: [N, V]; ids: [N] int32. One gather of N elements outside the kernels."""
  found = (ids >= 0) & (ids < vocab)
  picked = jnp.take_along_axis(x, jnp.where(found, ids, 0)[:, None], axis=1)[:, 0]
  return jnp.where(found, picked.astype(jnp.float32) * (1.0 / temperature), jnp.nan)
