"""The pure-JAX definition of the GRPO policy loss: the spec the Pallas kernels are tested against.

Everything is computed in float32 whatever the logits dtype, with plain autodiff for gradients. The
policy objective (:func:`kernels.objective.policy_objective`), the reduction (:func:`reduce_loss`) and
the aux packaging (:func:`make_aux`) are shared with the kernel paths (:func:`objective_and_loss`):
they are cheap [B, T] arithmetic, and the kernels only replace the per-token log-softmax over the
vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import loss_spec, support
from kernels.loss_spec import DEFAULT_MAX_LOG_RATIO, LOSS_TYPES, LossSpec
from kernels.objective import clamp_log_ratio, on_policy_log_ratio, policy_objective

__all__ = [
  "DEFAULT_MAX_LOG_RATIO",
  "LOSS_TYPES",
  "GRPOAux",
  "clamp_log_ratio",
  "grpo_loss_reference",
  "make_aux",
  "on_policy_log_ratio",
  "reduce_loss",
  "token_logps_and_entropy",
]


class GRPOAux(NamedTuple):
  """Per-token diagnostics, all [B, T] and 0 / False where ``completion_mask`` is 0."""

  per_token_logps: jax.Array  # [B, T] f32, log pi(completion_id); differentiable
  entropy: jax.Array  # [B, T] f32, entropy of softmax(logits / temperature); no gradient
  is_clipped: jax.Array  # [B, T] bool, the ratio's gradient is cut by the PPO clip or the dual clip
  per_token_kl: jax.Array  # [B, T] f32, KL(pi || ref) per spec.kl_estimator; 0 if beta == 0
  is_weight: jax.Array  # [B, T] f32, the importance weight w (1 when is_mode is None); no gradient
  sampler_log_ratio: jax.Array  # [B, T] f32, old - sampler_logps (0 without them); no gradient


def token_logps_and_entropy(
  logits,  # [..., V]
  ids,  # [...] int
  temperature,
  support_gap=None,  # [...] f32 or None: score each id over its sampled support (kernels.support)
):
  """log softmax(logits / T)[id] and the entropy, in f32. Ids outside [0, V) give NaN log-probs
  (negative ones included: they never wrap around to V - 1).

  With ``support_gap``, both are over the sampled support S = {v : z_v >= z_id + gap} (z = logits /
  T; :mod:`kernels.support`): the truncated, renormalised distribution the sampler drew from. A -inf
  gap is the full softmax. The entropy uses 0 * log 0 = 0, so -inf logits (a top-k / top-p mask, or
  columns outside S) leave it finite.
  """
  ids = ids.astype(jnp.int32)
  z = support.apply_gap(logits.astype(jnp.float32) / temperature, ids, support_gap)
  logsm = jax.nn.log_softmax(z, axis=-1)
  logp = support.chosen_logit(logsm, ids)
  p = jnp.exp(logsm)
  entropy = -jnp.sum(jnp.where(p == 0, 0.0, p * logsm), axis=-1)  # NaN still propagates
  return logp, jax.lax.stop_gradient(entropy)


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


def make_aux(mask, logp, entropy, obj) -> GRPOAux:
  """Aux with every field zeroed (False) at masked positions. mask, logp, entropy: [B, T]; obj: the
  :class:`kernels.objective.Objective` of the same tokens. Only logp and kl carry gradients."""
  zero = lambda x: jnp.where(mask, x, jnp.zeros_like(x))
  nograd = lambda x: zero(jax.lax.stop_gradient(x))
  return GRPOAux(
    zero(logp),
    nograd(entropy),
    zero(obj.is_clipped),
    zero(obj.kl),
    nograd(obj.is_weight),
    nograd(obj.sampler_log_ratio),
  )


def objective_and_loss(logp, entropy, mask, advantages, spec, *, num_items_in_batch, **logps):
  """The shared tail of every impl: the objective on per-token logp [B, T], the reduction, the aux.

  advantages: [B, T]; logps: old_logps / ref_logps / sampler_logps ([B, T] or None).
  """
  obj = policy_objective(logp, mask, advantages, spec, **logps)
  loss = reduce_loss(
    obj.per_token,
    mask,
    loss_type=spec.loss_type,
    max_completion_length=spec.max_completion_length,
    num_items_in_batch=num_items_in_batch,
  )
  return loss, make_aux(mask, logp, entropy, obj)


def grpo_loss_reference(
  logits,  # [B, T, V]
  completion_ids,  # [B, T] int
  completion_mask,  # [B, T] bool
  advantages,  # [B] or [B, T] f32
  *,
  old_logps=None,  # [B, T] f32 or None
  ref_logps=None,  # [B, T] f32 or None
  sampler_logps=None,  # [B, T] f32 or None
  support_gap=None,  # [B, T] f32 <= 0 or None: score over the sampled support (kernels.support)
  spec: LossSpec | None = None,
  num_items_in_batch=None,
  **options,  # LossSpec fields, as keywords (with spec: must agree with it)
):
  """Reference GRPO loss; same contract as :func:`kernels.grpo_loss` (inputs assumed validated).

  Gradients flow into ``logits`` only. Every input is replaced by 0 at masked positions before any
  arithmetic, so a NaN / inf there (padding, a stale row) reaches neither the loss nor a gradient.
  """
  spec = loss_spec.resolve(spec, **options)
  mask = completion_mask
  keep = lambda x: None if x is None else jnp.where(mask, jax.lax.stop_gradient(x), 0.0)
  adv = jnp.asarray(advantages, jnp.float32)
  adv = keep(adv[:, None] if adv.ndim == 1 else adv)
  logits = jnp.where(mask[..., None], logits, jnp.zeros((), logits.dtype))
  ids = jnp.where(mask, completion_ids, 0)
  logp, entropy = token_logps_and_entropy(logits, ids, spec.temperature, keep(support_gap))
  return objective_and_loss(
    logp,
    entropy,
    mask,
    adv,
    spec,
    num_items_in_batch=num_items_in_batch,
    old_logps=keep(old_logps),
    ref_logps=keep(ref_logps),
    sampler_logps=keep(sampler_logps),
  )
