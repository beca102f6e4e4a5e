"""Pallas kernels for the GRPO loss over the vocabulary: one forward pass, one backward pass.

Forward, per token row: an online max / sum-exp over vocabulary tiles (the tail masked in-kernel, never
padded in memory), the chosen token's logit, and the entropy's running sum, then — fused into the last
tile — the ratio, clip, k3 KL and the derivatives of the per-token loss w.r.t. log p.
Backward: dlogits = g / T * (onehot(id) - softmax(z)) tile by tile from the saved log-sum-exp; no f32
[N, V] array is ever built.

Two families share the per-token math (:func:`token_terms`):
  tiled   (TPU, CPU interpreter): grid (rows / bn, V / bv), the vocab axis a sequential reduction.
  rowloop (GPU / Triton):         grid (rows,), a fori_loop over vocab chunks with masked loads/stores.

All per-token inputs and outputs are flat f32 [N] (rowloop) or [N, 1] (tiled: a (bn, 1) block spans
the last dim, which satisfies Mosaic's tiling rule) arrays.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend
from kernels.backend import Target
from kernels.grpo_loss.blocks import LossBlocks
from kernels.grpo_loss.reference import DEFAULT_MAX_LOG_RATIO

# The running max starts at the most negative finite f32, not -inf: a tile of -inf logits (a top-k
# mask) then gives exp(-inf - m) = 0, never exp(-inf + inf) = NaN, and any finite logit (even -3e38)
# raises it. The rescale term guards alpha == 0 itself (see _online_update).
_NEG_BIG = -float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static (hashable) settings of one kernel call."""

  target: Target
  blocks: LossBlocks
  vocab: int
  on_policy: bool
  beta: float
  epsilon_low: float
  epsilon_high: float
  temperature: float
  reuse_logits_buffer: bool = False
  max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO


def token_terms(logp, old, ref, adv, cfg: LossConfig):
  """Per-token loss terms and their analytic derivatives w.r.t. log p (any shape, f32).

  Returns (per_token, kl, is_clipped as f32, d per_token / d logp, d kl / d logp).
  On-policy (old = stop_gradient(logp)) the ratio is exactly 1 and its derivative is 1. Both log-ratios
  are clamped to +-max_log_ratio before exp, with zero derivative at and beyond the bound, as in
  :func:`kernels.grpo_loss.reference.clamp_log_ratio`.
  """
  bound = cfg.max_log_ratio

  def clamped(d):  # (clamp(d), where the clamp is inactive: d clamp(d) / dd is 1 there, else 0)
    if bound is None:
      return d, True
    return jnp.clip(d, -bound, bound), jnp.abs(d) < bound

  if cfg.on_policy:  # ratio is exactly 1, but a NaN log p (bad id) must still poison the token
    ratio = jnp.where(logp == logp, jnp.float32(1.0), logp)  # logp != logp only for NaN
    dratio = ratio
  else:
    d, inside = clamped(logp - old)
    ratio = jnp.exp(d)
    dratio = jnp.where(inside, ratio, 0.0)
  lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
  is_clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
  per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
  # min() picks the constant clipped branch exactly when is_clipped; otherwise d/dlogp = -A * ratio.
  dpt = jnp.where(is_clipped, 0.0, -adv * dratio)
  if cfg.beta != 0.0:
    d, inside = clamped(ref - logp)
    e = jnp.exp(d)
    kl = e - d - 1.0
    dkl = jnp.where(inside, 1.0 - e, 0.0)
    per_token = per_token + cfg.beta * kl
    dpt = dpt + cfg.beta * dkl
  else:
    kl = jnp.zeros_like(logp)
    dkl = jnp.zeros_like(logp)
  return per_token, kl, is_clipped.astype(jnp.float32), dpt, dkl


# Rows whose max logit reaches this magnitude keep log-sum-exp relative to the max: at |m| ~ 3e38,
# m + log(l) rounds log(l) away (log 5 is far below one ulp), so logp and the softmax would be off by
# log(l). Below it the shift is 0 and every result is bit for bit the plain lse formula.
_SHIFT_AT = float(2**20)


def _finalize(m, l, s, chosen, found, old, ref, adv, cfg: LossConfig):
  """Per-token outputs, and the backward's residuals: the log-sum-exp is shift + lse_rel."""
  shift = jnp.where(jnp.abs(m) < _SHIFT_AT, 0.0, m)
  lse_rel = (m - shift) + jnp.log(l)
  entropy = jnp.log(l) - s / l
  # an id outside [0, V) poisons, never hides
  logp = jnp.where(found > 0, (chosen - shift) - lse_rel, jnp.nan)
  per_token, kl, clipped, dpt, dkl = token_terms(logp, old, ref, adv, cfg)
  return per_token, kl, logp, entropy, clipped, lse_rel, dpt, dkl, shift


def _online_update(z, hit, valid, m, l, s, chosen, found, axis):
  """Fold one tile of scaled logits z (invalid columns already -inf) into the running statistics."""
  hit = (
    hit & valid
  )  # an id in the tail tile's padding columns (>= V) is not found: NaN, as any id >= V
  m_new = jnp.maximum(m, jnp.max(z, axis=axis, keepdims=axis is not None))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(z - m_new)
  zc = jnp.where(valid, z - m_new, 0.0)
  keep = axis is not None
  # 0 * log 0 = 0: where p underflows (or z = -inf) the term is 0, not 0 * -inf; when alpha underflows
  # (a max jump past ~88, e.g. from -3e38 to 3e38) the old terms vanish instead of forming 0 * -inf.
  pz = jnp.where(p == 0, 0.0, p * zc)
  rescaled = jnp.where(alpha == 0, 0.0, alpha * (s + (m - m_new) * l))
  s = rescaled + jnp.sum(pz, axis=axis, keepdims=keep)
  l = alpha * l + jnp.sum(p, axis=axis, keepdims=keep)
  chosen = chosen + jnp.sum(jnp.where(hit, z, 0.0), axis=axis, keepdims=keep)
  found = found + jnp.sum(hit.astype(jnp.float32), axis=axis, keepdims=keep)
  return m_new, l, s, chosen, found


# ------------------------------------------------------------------------------------ tiled family
def _tiled_fwd_kernel(
  x_ref,
  ids_ref,
  old_ref,
  ref_ref,
  adv_ref,  # in
  pt_ref,
  kl_ref,
  logp_ref,
  ent_ref,
  clip_ref,
  lse_ref,
  dpt_ref,
  dkl_ref,
  shift_ref,  # out
  m_sc,
  l_sc,
  s_sc,
  c_sc,
  f_sc,
  *,
  cfg: LossConfig,
):
  j = pl.program_id(1)
  bv = cfg.blocks.block_v

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full_like(m_sc, _NEG_BIG)
    for ref in (l_sc, s_sc, c_sc, f_sc):
      ref[...] = jnp.zeros_like(ref)

  x = x_ref[...].astype(jnp.float32)  # [bn, bv]
  col = j * bv + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  valid = col < cfg.vocab
  z = jnp.where(valid, x * (1.0 / cfg.temperature), -jnp.inf)
  hit = col == ids_ref[...]  # [bn, bv] vs [bn, 1]
  m, l, s, c, f = _online_update(
    z, hit, valid, m_sc[...], l_sc[...], s_sc[...], c_sc[...], f_sc[...], axis=1
  )
  m_sc[...], l_sc[...], s_sc[...], c_sc[...], f_sc[...] = m, l, s, c, f

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    outs = _finalize(m, l, s, c, f, old_ref[...], ref_ref[...], adv_ref[...], cfg)
    for ref, val in zip(
      (pt_ref, kl_ref, logp_ref, ent_ref, clip_ref, lse_ref, dpt_ref, dkl_ref, shift_ref), outs
    ):
      ref[...] = val


def _tiled_bwd_kernel(x_ref, ids_ref, lse_ref, shift_ref, g_ref, dx_ref, *, cfg: LossConfig):
  j = pl.program_id(1)
  x = x_ref[...].astype(jnp.float32)
  col = j * cfg.blocks.block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  p = jnp.exp((x * (1.0 / cfg.temperature) - shift_ref[...]) - lse_ref[...])
  onehot = (col == ids_ref[...]).astype(jnp.float32)
  g = g_ref[...]
  # g == 0 (a masked token): exactly 0, even where its logits are NaN / inf. Out-of-range columns are
  # dropped by the store.
  dx_ref[...] = jnp.where(g == 0, 0.0, g * (onehot - p)).astype(dx_ref.dtype)


def _tiled_fwd(cfg: LossConfig, x, ids, old, ref, adv):
  n, v = x.shape
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  col = lambda a: a.reshape(n, 1)
  row_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  outs = pl.pallas_call(
    functools.partial(_tiled_fwd_kernel, cfg=cfg),
    grid=(pl.cdiv(n, bn), pl.cdiv(v, bv)),
    in_specs=[pl.BlockSpec((bn, bv), lambda i, j: (i, j))] + [row_spec] * 4,
    out_specs=[row_spec] * 9,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * 9,
    scratch_shapes=[backend.scratch_vmem((bn, 1), jnp.float32)] * 5,
    compiler_params=backend.compiler_params(
      cfg.target, dimension_semantics=("parallel", "arbitrary")
    ),
    interpret=cfg.target.interpret,
    name="grpo_loss_fwd",
  )(x, col(ids), col(old), col(ref), col(adv))
  return tuple(o.reshape(n) for o in outs)


def _tiled_bwd(cfg: LossConfig, x, ids, lse, shift, g):
  n, v = x.shape
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  tile = pl.BlockSpec((bn, bv), lambda i, j: (i, j))
  row_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
  return pl.pallas_call(
    functools.partial(_tiled_bwd_kernel, cfg=cfg),
    grid=(pl.cdiv(n, bn), pl.cdiv(v, bv)),
    in_specs=[tile] + [row_spec] * 4,
    out_specs=tile,
    out_shape=jax.ShapeDtypeStruct((n, v), x.dtype),
    input_output_aliases={0: 0} if cfg.reuse_logits_buffer else {},
    compiler_params=backend.compiler_params(
      cfg.target, dimension_semantics=("parallel", "parallel")
    ),
    interpret=cfg.target.interpret,
    name="grpo_loss_bwd",
  )(x, *(a.reshape(n, 1) for a in (ids, lse, shift, g)))


# ---------------------------------------------------------------------------------- rowloop family
def _rowloop_fwd_kernel(
  x_ref,
  ids_ref,
  old_ref,
  ref_ref,
  adv_ref,
  pt_ref,
  kl_ref,
  logp_ref,
  ent_ref,
  clip_ref,
  lse_ref,
  dpt_ref,
  dkl_ref,
  shift_ref,
  *,
  cfg: LossConfig,
):
  bv, vocab = cfg.blocks.block_v, cfg.vocab
  token = ids_ref[...]

  def body(k, carry):
    cols = k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(k * bv, bv)], mask=valid, other=0.0).astype(jnp.float32)
    z = jnp.where(valid, x * (1.0 / cfg.temperature), -jnp.inf)
    return _online_update(z, cols == token, valid, *carry, axis=None)

  zero = jnp.float32(0.0)
  m, l, s, c, f = jax.lax.fori_loop(
    0, pl.cdiv(vocab, bv), body, (jnp.float32(_NEG_BIG), zero, zero, zero, zero)
  )
  outs = _finalize(m, l, s, c, f, old_ref[...], ref_ref[...], adv_ref[...], cfg)
  for ref, val in zip(
    (pt_ref, kl_ref, logp_ref, ent_ref, clip_ref, lse_ref, dpt_ref, dkl_ref, shift_ref), outs
  ):
    ref[...] = val


def _rowloop_bwd_kernel(x_ref, ids_ref, lse_ref, shift_ref, g_ref, dx_ref, *, cfg: LossConfig):
  bv, vocab = cfg.blocks.block_v, cfg.vocab
  token, lse, shift, g = ids_ref[...], lse_ref[...], shift_ref[...], g_ref[...]

  @pl.loop(0, pl.cdiv(vocab, bv))
  def _chunk(k):
    cols = k * bv + jnp.arange(bv, dtype=jnp.int32)
    valid = cols < vocab
    x = backend.masked_load(x_ref.at[pl.ds(k * bv, bv)], mask=valid, other=0.0).astype(jnp.float32)
    p = jnp.exp((x * (1.0 / cfg.temperature) - shift) - lse)
    d = jnp.where(g == 0, 0.0, g * ((cols == token).astype(jnp.float32) - p))  # see _tiled_bwd
    backend.masked_store(dx_ref.at[pl.ds(k * bv, bv)], d.astype(dx_ref.dtype), mask=valid)


def _rowloop_params(cfg: LossConfig):
  return backend.compiler_params(
    cfg.target, num_warps=cfg.blocks.num_warps, num_stages=cfg.blocks.num_stages
  )


def _rowloop_fwd(cfg: LossConfig, x, ids, old, ref, adv):
  n, v = x.shape
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  return tuple(
    pl.pallas_call(
      functools.partial(_rowloop_fwd_kernel, cfg=cfg),
      grid=(n,),
      in_specs=[pl.BlockSpec((None, v), lambda i: (i, 0))] + [scalar] * 4,
      out_specs=[scalar] * 9,
      out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 9,
      compiler_params=_rowloop_params(cfg),
      interpret=cfg.target.interpret,
      name="grpo_loss_fwd",
    )(x, ids, old, ref, adv)
  )


def _rowloop_bwd(cfg: LossConfig, x, ids, lse, shift, g):
  n, v = x.shape
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  row = pl.BlockSpec((None, v), lambda i: (i, 0))
  return pl.pallas_call(
    functools.partial(_rowloop_bwd_kernel, cfg=cfg),
    grid=(n,),
    in_specs=[row] + [scalar] * 4,
    out_specs=row,
    out_shape=jax.ShapeDtypeStruct((n, v), x.dtype),
    input_output_aliases={0: 0} if cfg.reuse_logits_buffer else {},
    compiler_params=_rowloop_params(cfg),
    interpret=cfg.target.interpret,
    name="grpo_loss_bwd",
  )(x, ids, lse, shift, g)


# ------------------------------------------------------------------------------ differentiable op
def _fwd_call(cfg, *args):
  return (_rowloop_fwd if cfg.target.family == "rowloop" else _tiled_fwd)(cfg, *args)


def _bwd_call(cfg, *args):
  return (_rowloop_bwd if cfg.target.family == "rowloop" else _tiled_bwd)(cfg, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def per_token_terms(cfg: LossConfig, logits, ids, old, ref, adv):
  """(per_token_loss, kl, logp, entropy, is_clipped) for flat tokens; differentiable w.r.t. logits.

  logits: [N, V] bf16/f32; ids: [N] int32 in [0, V); old, ref, adv: [N] f32 (placeholders when unused).
  Gradients flow into ``logits`` only (the public op stop-gradients old, ref and adv).
  """
  pt, kl, logp, ent, clip, *_ = _fwd_call(cfg, logits, ids, old, ref, adv)
  return pt, kl, logp, ent, clip


def _vjp_fwd(cfg, logits, ids, old, ref, adv):
  pt, kl, logp, ent, clip, lse, dpt, dkl, shift = _fwd_call(cfg, logits, ids, old, ref, adv)
  return (pt, kl, logp, ent, clip), (logits, ids, lse, shift, dpt, dkl)


def _vjp_bwd(cfg, res, cts):
  logits, ids, lse, shift, dpt, dkl = res
  ct_pt, ct_kl, ct_logp, _, _ = cts  # entropy and is_clipped carry no gradient
  # A zero cotangent (a masked token) contributes exactly 0, even where the token's terms are NaN.
  times = lambda ct, d: jnp.where(ct == 0, 0.0, ct * d)
  g = (times(ct_pt, dpt) + times(ct_kl, dkl) + ct_logp) * (1.0 / cfg.temperature)
  dlogits = _bwd_call(cfg, logits, ids, lse, shift, g)
  return dlogits, None, None, None, None


per_token_terms.defvjp(_vjp_fwd, _vjp_bwd)


# --------------------------------------------------------------- building blocks for other ops
def row_stats(cfg: LossConfig, logits, ids):
  """(lse, logp, entropy) per row of [N, V] logits (scaled by 1 / temperature), from the forward kernel.

  logp is NaN where the id is outside [0, V) (the fused LM-head loss uses this to find which vocabulary
  shard holds a token). ``cfg`` should be on-policy with beta = 0: the loss terms are not needed.
  """
  zeros = jnp.zeros(ids.shape, jnp.float32)
  _, _, logp, entropy, _, lse, _, _, shift = _fwd_call(cfg, logits, ids, zeros, zeros, zeros)
  return shift + lse, logp, entropy


def softmax_grad(cfg: LossConfig, logits, ids, lse, g):
  """g[n] * (onehot(id_n) - exp(z[n] - lse[n])) with z = logits / temperature, from the backward kernel."""
  return _bwd_call(cfg, logits, ids, lse, jnp.zeros_like(lse), g)
