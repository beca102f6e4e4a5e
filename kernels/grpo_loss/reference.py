"""The pure-JAX definition of the GRPO policy loss: the spec the Pallas kernels are tested against.

Everything is computed in float32 whatever the logits dtype, with plain autodiff for gradients. The
reduction (:func:`reduce_loss`) and the aux packaging (:func:`make_aux`) are shared with the kernel path:
they are cheap [B, T] arithmetic, and the kernels only replace the per-token work over the vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


class GRPOAux(NamedTuple):
  """Per-token diagnostics, all [B, T] and 0 / False where ``completion_mask`` is 0."""

  per_token_logps: jax.Array  # [B, T] f32, log pi(completion_id); differentiable
  entropy: jax.Array  # [B, T] f32, entropy of softmax(logits / temperature); no gradient
  is_clipped: jax.Array  # [B, T] bool, the clipped branch of the PPO objective is active
  per_token_kl: (
    jax.Array
  )  # [B, T] f32, k3 estimate of KL(pi || ref), differentiable; 0 if beta == 0


DEFAULT_MAX_LOG_RATIO = 20.0  # tunix's bound: exp(20) ~ 4.9e8 keeps every term finite in f32


def token_logps_and_entropy(logits, ids, temperature):
  """log softmax(logits / T)[id] and the entropy, in f32. Ids outside [0, V) give NaN log-probs
  (negative ones included: they never wrap around to V - 1).

  The entropy uses 0 * log 0 = 0, so -inf logits (a top-k / top-p mask) leave it finite.
  logits: [..., V]; ids: [...] int.
  """
  z = logits.astype(jnp.float32) / temperature
  logsm = jax.nn.log_softmax(z, axis=-1)
  ids = ids.astype(jnp.int32)
  inside = (ids >= 0) & (ids < z.shape[-1])
  picked = jnp.take_along_axis(logsm, jnp.where(inside, ids, 0)[..., None], axis=-1)[..., 0]
  logp = jnp.where(inside, picked, jnp.nan)
  p = jnp.exp(logsm)
  entropy = -jnp.sum(jnp.where(p == 0, 0.0, p * logsm), axis=-1)  # NaN still propagates
  return logp, jax.lax.stop_gradient(entropy)


def clamp_log_ratio(d, max_log_ratio):
  """d clamped to [-max_log_ratio, max_log_ratio], with zero gradient at and beyond the bound; NaN
  stays NaN. None: d unchanged. d: [...] f32."""
  if max_log_ratio is None:
    return d
  inside = jnp.abs(d) < max_log_ratio
  return jnp.where(inside, d, jax.lax.stop_gradient(jnp.clip(d, -max_log_ratio, max_log_ratio)))


@jax.custom_jvp
def on_policy_ratio(logp):
  """exp(logp - stop_gradient(logp)): 1 with derivative 1, also where logp = -inf (the textbook
  formula gives -inf - -inf = NaN there). A NaN log p (an id outside [0, V)) stays NaN. logp: [...]."""
  return jnp.where(logp == logp, jnp.float32(1.0), logp)


@on_policy_ratio.defjvp
def _on_policy_ratio_jvp(primals, tangents):
  return on_policy_ratio(primals[0]), tangents[0]


def per_token_objective(
  logp,
  old_logps,
  ref_logps,
  adv,
  *,
  beta,
  epsilon_low,
  epsilon_high,
  max_log_ratio=DEFAULT_MAX_LOG_RATIO,
):
  """Clipped-surrogate loss plus beta * k3 KL per token, by the textbook formula (autodiff'd), with
  both log-ratios clamped to +-max_log_ratio before exp.

  logp, old_logps, ref_logps: [...] f32 (old None = on-policy; ref None when beta == 0); adv: [...].
  Returns (per_token_loss, per_token_kl, is_clipped).
  """
  if old_logps is None:
    ratio = on_policy_ratio(logp)
  else:
    ratio = jnp.exp(clamp_log_ratio(logp - old_logps, max_log_ratio))
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)
  is_clipped = ((adv > 0) & (ratio > 1.0 + epsilon_high)) | (
    (adv < 0) & (ratio < 1.0 - epsilon_low)
  )
  if beta != 0.0:
    d = clamp_log_ratio(ref_logps - logp, max_log_ratio)
    kl = jnp.exp(d) - d - 1.0
    per_token = per_token + beta * kl
  else:
    kl = jnp.zeros_like(logp)
  return per_token, kl, is_clipped


def reduce_loss(per_token, mask, *, loss_type, max_completion_length=None, num_items_in_batch=None):
  """Normalise masked per-token losses into the scalar loss.

  per_token: [B, T] f32 (may hold NaN where mask == 0: masked entries are selected away, not
  multiplied, so they never poison the sum); mask: [B, T] bool.
  """
  b, t = per_token.shape
  masked = jnp.where(mask, per_token, 0.0)
  maskf = mask.astype(jnp.float32)
  if loss_type == "grpo":
    per_seq = masked.sum(-1) / jnp.maximum(maskf.sum(-1), 1.0)
    return per_seq.mean()
  if loss_type == "bnpo":
    return masked.sum() / jnp.maximum(maskf.sum(), 1.0)
  if loss_type == "dr_grpo":
    length = t if max_completion_length is None else max_completion_length
    return masked.sum() / (b * length)
  if loss_type == "dapo":
    if num_items_in_batch is None:
      return masked.sum() / jnp.maximum(maskf.sum(), 1.0)
    # A concrete count <= 0 is rejected up front; a traced one gives NaN, never +-inf.
    return jnp.where(num_items_in_batch > 0, masked.sum() / num_items_in_batch, jnp.nan)
  raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")


def make_aux(mask, logp, entropy, is_clipped, kl) -> GRPOAux:
  """Aux with every field zeroed (False) at masked positions. All arguments [B, T]."""
  zero = lambda x: jnp.where(mask, x, jnp.zeros_like(x))
  return GRPOAux(zero(logp), zero(entropy), zero(is_clipped), zero(kl))


def grpo_loss_reference(
  logits,  # [B, T, V]
  completion_ids,  # [B, T] int
  completion_mask,  # [B, T] bool
  advantages,  # [B]
  *,
  old_logps=None,  # [B, T] f32 or None
  ref_logps=None,  # [B, T] f32 or None
  beta=0.0,
  epsilon_low=0.2,
  epsilon_high=0.2,
  temperature=1.0,
  loss_type="grpo",
  max_completion_length=None,
  num_items_in_batch=None,
  max_log_ratio=DEFAULT_MAX_LOG_RATIO,
):
  """Reference GRPO loss; same contract as :func:`kernels.grpo_loss` (inputs assumed validated).

  Gradients flow into ``logits`` only. Every input is replaced by 0 at masked positions before any
  arithmetic, so a NaN / inf there (padding, a stale row) reaches neither the loss nor a gradient.
  """
  mask = completion_mask
  keep = lambda x: None if x is None else jnp.where(mask, jax.lax.stop_gradient(x), 0.0)
  old_logps, ref_logps = keep(old_logps), keep(ref_logps)
  adv = keep(jnp.asarray(advantages, jnp.float32)[:, None])
  logits = jnp.where(mask[..., None], logits, jnp.zeros((), logits.dtype))
  ids = jnp.where(mask, completion_ids, 0)
  logp, entropy = token_logps_and_entropy(logits, ids, temperature)
  per_token, kl, is_clipped = per_token_objective(
    logp,
    old_logps,
    ref_logps,
    adv,
    beta=beta,
    epsilon_low=epsilon_low,
    epsilon_high=epsilon_high,
    max_log_ratio=max_log_ratio,
  )
  loss = reduce_loss(
    per_token,
    mask,
    loss_type=loss_type,
    max_completion_length=max_completion_length,
    num_items_in_batch=num_items_in_batch,
  )
  return loss, make_aux(mask, logp, entropy, is_clipped, kl)
