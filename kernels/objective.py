"""The policy objective on per-token log-probs: the one [B, T] definition every impl shares.

Every impl of ``grpo_loss`` / ``fused_linear_grpo_loss`` reduces the logits to per-token log-probs
``logp`` [B, T] and applies :func:`policy_objective` — plain JAX on [B, T] arrays — for the loss value.
Gradients: sequence-level options (GSPO, sequence importance weights) need per-sequence sums of
log-probs, so there autodiff of this function gives d loss / d logp for a backward kernel (three passes
over the logits). Token-level options make a token's loss a function of its own log p: then
:func:`token_coefficient` (autodiff of the same function, elementwise) runs inside the training kernels
once a row's log p is known, and dlogits are written in the forward's pass (two passes in all). One
definition keeps the options identical across impls by construction; it costs O(B * T) against the
kernels' O(B * T * V).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.loss_spec import LossSpec


class Objective(NamedTuple):
  """Per-token terms, all [B, T] f32 (is_clipped bool); values at masked positions are unspecified
  (finite) and every consumer selects them away."""

  per_token: jax.Array  # w * (-surrogate) + beta * kl
  kl: jax.Array  # the KL(pi || ref) estimate (spec.kl_estimator), 0 when beta == 0
  is_clipped: jax.Array  # the ratio's gradient is cut by the PPO clip or the dual clip
  is_weight: jax.Array  # stop_gradient(w), 1 when is_mode is None
  sampler_log_ratio: jax.Array  # old - s, 0 without sampler log-probs


def clamp_log_ratio(d, max_log_ratio):
  """d clamped to [-max_log_ratio, max_log_ratio], with zero gradient at and beyond the bound; NaN
  stays NaN. None: d unchanged. d: [...] f32."""
  if max_log_ratio is None:
    return d
  inside = jnp.abs(d) < max_log_ratio
  return jnp.where(inside, d, jax.lax.stop_gradient(jnp.clip(d, -max_log_ratio, max_log_ratio)))


@jax.custom_jvp
def on_policy_log_ratio(logp):
  """logp - stop_gradient(logp): 0 with derivative 1, also where logp = -inf (the textbook formula
  gives -inf - -inf = NaN there). A NaN log p (an id outside [0, V)) stays NaN. logp: [...]."""
  return jnp.where(logp == logp, jnp.float32(0.0), logp)


@on_policy_log_ratio.defjvp
def _on_policy_log_ratio_jvp(primals, tangents):
  return on_policy_log_ratio(primals[0]), tangents[0]


def _masked_sum(x, mask):  # [B, T] -> [B, 1]
  return jnp.sum(jnp.where(mask, x, 0.0), axis=-1, keepdims=True)


def policy_objective(
  logp,  # [B, T] f32, differentiable; anything (even NaN) at masked positions
  mask,  # [B, T] bool
  advantages,  # [B, T] f32
  spec: LossSpec,
  *,
  old_logps=None,  # [B, T] f32 or None (on-policy: old = stop_gradient(logp))
  ref_logps=None,  # [B, T] f32, used when spec.beta != 0
  sampler_logps=None,  # [B, T] f32 or None
) -> Objective:
  """Per token (``M = max_log_ratio``, ``old`` = old_logps or stop_gradient(logp), ``s`` = sampler)::

      token level:     r_t = logp_t - old_t
      sequence (GSPO): r_t = L_b = sum_t m_t (logp_t - old_t) / max(sum_t m_t, 1)   (grad through logp)
      sequence_token:  r_t = logp_t - sg(logp_t) + sg(min(L'_b, cap)),  L'_b the same mean of
                       clamp(logp_t - old_t, -M, M)   (GSPO-token; zero gradient where L'_b > cap)
      ratio     = exp(clamp(r, -M, M))
      surrogate = min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
      dual clip (epsilon_c = c): where A < 0, surrogate = max(surrogate, c * A)
      IS weight: rho_t = exp(old_t - s_t) (token modes) or exp(sum_t m_t (old_t - s_t)) (sequence
                 modes, shared by the sequence's tokens); truncate: w = min(rho, is_cap);
                 mask: w = rho if rho <= is_cap else 0; w = 1 without is_mode
      per_token = -stop_gradient(w) * surrogate + beta * kl(d),  d = clamp(ref - logp, -M, M)
      kl(d) = exp(d) - d - 1 (k3, default) | -d (k1) | d^2 / 2 (k2)

  ``clamp`` has zero gradient at and beyond the bound. With the defaults (token level, no IS, no dual
  clip) this is bit for bit the formula before these options existed.
  """
  logp = jnp.where(mask, logp, 0.0)  # masked garbage reaches neither a value nor a cotangent
  bound = spec.max_log_ratio
  if old_logps is None:
    old = jax.lax.stop_gradient(logp)
    log_ratio = on_policy_log_ratio(logp)
  else:
    old = old_logps
    log_ratio = logp - old_logps
  if spec.importance_sampling_level == "sequence":
    count = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32), 1.0)
    log_ratio = jnp.broadcast_to(_masked_sum(log_ratio, mask) / count, logp.shape)
  elif spec.importance_sampling_level == "sequence_token":
    log_ratio = _sequence_token_log_ratio(logp, log_ratio, mask, spec)
  ratio = jnp.exp(clamp_log_ratio(log_ratio, bound))
  adv = advantages
  lo, hi = 1.0 - spec.epsilon_low, 1.0 + spec.epsilon_high
  per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
  is_clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
  if spec.epsilon_c is not None:
    # -surrogate > -c * A  <=>  the loss exceeds c * |A| (A < 0): capped, no gradient through ratio
    capped = (adv < 0) & (per_token > -spec.epsilon_c * adv)
    per_token = jnp.where(capped, -spec.epsilon_c * adv, per_token)
    is_clipped = is_clipped | capped

  if sampler_logps is None:
    sampler_log_ratio = jnp.zeros_like(logp)
  else:
    sampler_log_ratio = jnp.where(mask, jax.lax.stop_gradient(old) - sampler_logps, 0.0)
  if spec.is_mode is None:
    is_weight = jnp.ones_like(logp)
  else:
    x = sampler_log_ratio
    if spec.is_mode.startswith("sequence"):
      x = jnp.broadcast_to(_masked_sum(x, mask), logp.shape)
    rho = jnp.exp(x)  # +inf for a stale sampler: min() gives the cap, the mask mode 0
    if spec.is_mode.endswith("truncate"):
      is_weight = jnp.minimum(rho, spec.is_cap)
    else:
      is_weight = jnp.where(rho <= spec.is_cap, rho, 0.0)
    per_token = per_token * is_weight

  if spec.beta != 0.0:
    kl = kl_divergence(ref_logps - logp, spec)
    per_token = per_token + spec.beta * kl
  else:
    kl = jnp.zeros_like(logp)
  return Objective(per_token, kl, is_clipped, is_weight, sampler_log_ratio)


def kl_divergence(d, spec: LossSpec):
  """The per-token KL estimate of d = ref - logp ([B, T] f32), clamped to +-max_log_ratio first:
  k3 = exp(d) - d - 1, k1 = -d, k2 = d^2 / 2 (``spec.kl_estimator``)."""
  d = clamp_log_ratio(d, spec.max_log_ratio)
  if spec.kl_estimator == "k1":
    return -d
  if spec.kl_estimator == "k2":
    return 0.5 * d * d
  return jnp.exp(d) - d - 1.0


def _sequence_token_log_ratio(logp, log_ratio, mask, spec: LossSpec):
  """GSPO-token's log-ratio: in value the sequence's masked mean of the per-token log-ratios, each
  clamped to +-max_log_ratio first (then capped above at ``sequence_log_ratio_cap``); in gradient
  the token's own log p (d r_t / d logp_t = 1, zero beyond the cap). [B, T] f32 in and out."""
  count = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32), 1.0)
  clamped = clamp_log_ratio(log_ratio, spec.max_log_ratio)
  seq = jax.lax.stop_gradient(_masked_sum(clamped, mask) / count)  # [B, 1]
  r = on_policy_log_ratio(logp) + seq
  cap = spec.sequence_log_ratio_cap
  if cap is None:
    return r
  return jnp.where(seq < cap, r, jnp.float32(cap))


def token_coefficient(
  logp,  # [...] f32: one token's log p per element (the training kernels: [bn, 1] or a scalar)
  mask,  # [...] bool
  advantages,  # [...] f32
  weight,  # [...] f32: the token's weight in the loss, d loss / d per_token
  spec: LossSpec,
  *,
  old_logps=None,  # [...] f32 or None
  ref_logps=None,  # [...] f32 or None
  sampler_logps=None,  # [...] f32 or None
):
  """d (weight * per_token) / d logp, elementwise: the per-token coefficient of the loss's gradient.

  For token-level specs a token's loss depends on its own log p only, so this is exactly that token's
  d loss / d logp — computed by autodiff of :func:`policy_objective` itself (one definition for every
  impl), elementwise, so the training kernels evaluate it in-kernel the moment a row's log p is known
  and write dlogits in the same pass. Sequence-level specs need the whole sequence first: ValueError.
  """
  if spec.sequence_level:
    raise ValueError("token_coefficient needs a token-level LossSpec (no GSPO / sequence IS mode)")

  def per_token(lp):
    return policy_objective(
      lp,
      mask,
      advantages,
      spec,
      old_logps=old_logps,
      ref_logps=ref_logps,
      sampler_logps=sampler_logps,
    ).per_token

  _, vjp = jax.vjp(per_token, logp)
  return vjp(weight)[0]
