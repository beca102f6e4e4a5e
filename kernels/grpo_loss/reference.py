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
  per_token_kl: jax.Array  # [B, T] f32, k3 estimate of KL(pi || ref); zeros when beta == 0


def token_logps_and_entropy(logits, ids, temperature):
  """log softmax(logits / T)[id] and the entropy, in f32. Out-of-range ids give NaN log-probs.

  logits: [..., V]; ids: [...] int.
  """
  z = logits.astype(jnp.float32) / temperature
  logsm = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(
    logsm, ids[..., None].astype(jnp.int32), axis=-1, mode="fill", fill_value=jnp.nan
  )[..., 0]
  entropy = -jnp.sum(jnp.exp(logsm) * logsm, axis=-1)
  return logp, jax.lax.stop_gradient(entropy)


def per_token_objective(logp, old_logps, ref_logps, adv, *, beta, epsilon_low, epsilon_high):
  """Clipped-surrogate loss plus beta * k3 KL per token, by the textbook formula (autodiff'd).

  logp, old_logps, ref_logps: [...] f32 (old None = on-policy; ref None when beta == 0); adv: [...].
  Returns (per_token_loss, per_token_kl, is_clipped).
  """
  old = jax.lax.stop_gradient(logp) if old_logps is None else old_logps
  ratio = jnp.exp(logp - old)
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)
  is_clipped = ((adv > 0) & (ratio > 1.0 + epsilon_high)) | (
    (adv < 0) & (ratio < 1.0 - epsilon_low)
  )
  if beta != 0.0:
    d = ref_logps - logp
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
    count = jnp.maximum(maskf.sum(), 1.0) if num_items_in_batch is None else num_items_in_batch
    return masked.sum() / count
  raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")


def make_aux(mask, logp, entropy, is_clipped, kl) -> GRPOAux:
  """Aux with every field zeroed (False) at masked positions. All arguments [B, T]."""
  zero = lambda x: jnp.where(mask, x, jnp.zeros_like(x))
  return GRPOAux(zero(logp), zero(entropy), zero(is_clipped), zero(kl))


def grpo_loss_reference(
  logits,
  completion_ids,
  completion_mask,
  advantages,
  *,
  old_logps=None,
  ref_logps=None,
  beta=0.0,
  epsilon_low=0.2,
  epsilon_high=0.2,
  temperature=1.0,
  loss_type="grpo",
  max_completion_length=None,
  num_items_in_batch=None,
):
  """Reference GRPO loss; same contract as :func:`kernels.grpo_loss` (inputs assumed validated).

  logits: [B, T, V]; completion_ids: [B, T] int; completion_mask: [B, T] bool; advantages: [B];
  old_logps, ref_logps: [B, T] f32 or None. Gradients flow into ``logits`` only.
  """
  old_logps = None if old_logps is None else jax.lax.stop_gradient(old_logps)
  ref_logps = None if ref_logps is None else jax.lax.stop_gradient(ref_logps)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))[:, None]
  logp, entropy = token_logps_and_entropy(logits, completion_ids, temperature)
  per_token, kl, is_clipped = per_token_objective(
    logp, old_logps, ref_logps, adv, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high
  )
  loss = reduce_loss(
    per_token,
    completion_mask,
    loss_type=loss_type,
    max_completion_length=max_completion_length,
    num_items_in_batch=num_items_in_batch,
  )
  return loss, make_aux(completion_mask, logp, entropy, is_clipped, kl)
