"""PPO pieces for multi-turn episodes: GAE over model tokens, advantage whitening, the clipped value
loss, the per-token-advantage policy term, and the PPO / critic metrics.

All arrays are over the completion part of packed rows ([B, T] with T = the completion width, see
`rl.rollout.multiturn.pack_episodes`); `mask` marks MODEL tokens. Environment and padding tokens are
skipped: GAE runs over the model tokens of a row in order, as if the environment tokens between two
turns were not there, with each turn's reward on that turn's last model token:

    delta_k = r_k + gamma * V_{k+1} - V_k          (V_{K} = 0 after the row's last model token)
    A_k     = delta_k + gamma * lambda * A_{k+1}
    R_k     = A_k + V_k                            (the value target)

An episode cut by max_seq_len is treated as ended there (no bootstrap).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import kernels
from kernels.grpo_loss import DEFAULT_MAX_LOG_RATIO


def _check_same_shape(**arrays) -> None:
  shapes = {k: tuple(v.shape) for k, v in arrays.items() if v is not None}
  first = next(iter(shapes.values()))
  bad = {k: s for k, s in shapes.items() if s != first}
  if bad or len(first) != 2:
    raise ValueError(f"expected [B, T] arrays of one shape, got {shapes}")


def gae(
  rewards,  # [B, T] f32, non-zero only on MODEL tokens (each turn's last one)
  values,  # [B, T] f32, the critic's value of each token's state
  mask,  # [B, T] bool, MODEL tokens
  gamma: float,
  lam: float,
):  # -> (advantages [B, T], returns [B, T]), 0 where mask is False
  """Generalised advantage estimation over each row's MODEL tokens (others skipped, see above)."""
  _check_same_shape(rewards=rewards, values=values, mask=mask)
  for name, v in (("gamma", gamma), ("lam", lam)):
    if not 0.0 <= v <= 1.0:
      raise ValueError(f"{name} must be in [0, 1], got {v}")
  rewards, values = jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32)
  return _gae(rewards, values, jnp.asarray(mask, bool), float(gamma), float(lam))


# Jitted with the scalars static: an eager lax.scan traces a new body function on every call, so
# rl.agent's step compiled a `scan` every step (a compile per step that no step-time figure excludes).
@functools.partial(jax.jit, static_argnums=(3, 4))
def _gae(rewards, values, mask, gamma: float, lam: float):  # [B, T] x3 -> ([B, T], [B, T])
  rewards, values = jnp.where(mask, rewards, 0.0), jnp.where(mask, values, 0.0)

  def back(carry, x):  # one position, right to left; skipped positions pass the carry through
    next_value, next_adv = carry
    r, v, m = x
    adv = r + gamma * next_value - v + gamma * lam * next_adv
    return (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv)), jnp.where(m, adv, 0.0)

  zero = jnp.zeros(rewards.shape[0], jnp.float32)
  _, adv = jax.lax.scan(back, (zero, zero), (rewards.T, values.T, mask.T), reverse=True)
  adv = adv.T
  return adv, jnp.where(mask, adv + values, 0.0)


def whiten(x, mask, eps: float = 1e-8):  # [B, T], [B, T] -> [B, T]
  """(x - mean) / (std + eps) over the masked entries of the whole batch; 0 elsewhere. A batch whose
  entries are all equal gives 0 (no signal), never NaN."""
  mask = jnp.asarray(mask, bool)
  n = jnp.maximum(mask.sum(), 1)
  mean = jnp.where(mask, x, 0.0).sum() / n
  centred = jnp.where(mask, x - mean, 0.0)
  std = jnp.sqrt((centred**2).sum() / n)
  return jnp.where(std > 0, centred / (std + eps), 0.0)


def value_loss(
  values,  # [B, T] f32, the critic now (differentiable)
  old_values,  # [B, T] f32, the critic when the episodes were scored
  returns,  # [B, T] f32, GAE targets
  mask,  # [B, T] bool
  value_clip: float | None,
):  # -> ([B, T] per-token loss, 0 off the mask; [B, T] bool, clipped branch chosen)
  """PPO's clipped value loss, per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2).
  value_clip None: the plain 0.5 * (V - R)^2. Reduce it with the policy term's normalisation."""
  old_values, returns = jax.lax.stop_gradient(old_values), jax.lax.stop_gradient(returns)
  plain = (values - returns) ** 2
  if value_clip is None:
    return jnp.where(mask, 0.5 * plain, 0.0), jnp.zeros(values.shape, bool)
  clipped_v = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
  clipped = (clipped_v - returns) ** 2
  return jnp.where(mask, 0.5 * jnp.maximum(plain, clipped), 0.0), mask & (clipped > plain)


def policy_loss(
  logits,  # [B, T, V]; with lm_head: the [B, T, H] hidden states scoring the tokens
  ids,  # [B, T] int
  mask,  # [B, T] bool, MODEL tokens
  advantages,  # [B, T] f32, per token
  *,
  old_logps=None,  # [B, T] f32 or None (on-policy)
  ref_logps=None,  # [B, T] f32, the reference policy's; required when beta > 0
  beta: float = 0.0,  # weight of the k3 KL(pi || ref) per token
  epsilon_low: float = 0.2,
  epsilon_high: float = 0.2,
  temperature: float = 1.0,
  loss_type: str = "grpo",
  max_completion_length: int | None = None,
  num_items_in_batch=None,
  max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO,
  impl: str = "auto",
  lm_head=None,  # [H, V]: the fused LM-head loss (no [B, T, V] logits)
  support_gap=None,  # [B, T] f32 or None: score over the sampled support (rl.support)
  sharding=None,  # kernels.sharding.KernelSharding: shard-local over a mesh (rl.kernel_sharding)
):  # -> (loss, kernels.grpo_loss.GRPOAux)
  """The PPO clipped surrogate with per-token advantages: kernels.grpo_loss (Pallas / XLA / Mosaic
  GPU by `impl`), or kernels.fused_linear_grpo_loss when `lm_head` is given, with [B, T] advantages;
  their semantics otherwise (reductions, the log-ratio clamp, masked positions ignored). [B] advantages are refused here: a caller of the PPO term that passes
  per-sequence ones has lost its GAE output."""
  if getattr(advantages, "shape", None) != tuple(ids.shape):
    raise ValueError(
      f"advantages must be per token, [B, T] = {tuple(ids.shape)}, got "
      f"{getattr(advantages, 'shape', type(advantages).__name__)}"
    )
  kw = dict(
    old_logps=old_logps,
    ref_logps=ref_logps,
    beta=beta,
    epsilon_low=epsilon_low,
    epsilon_high=epsilon_high,
    temperature=temperature,
    loss_type=loss_type,
    max_completion_length=max_completion_length,
    num_items_in_batch=num_items_in_batch,
    max_log_ratio=max_log_ratio,
    impl=impl,
    sharding=sharding,
  )
  if lm_head is not None:
    return kernels.fused_linear_grpo_loss(
      logits.astype(lm_head.dtype), lm_head, ids, mask, advantages, support_gap=support_gap, **kw
    )
  return kernels.grpo_loss(logits, ids, mask, advantages, support_gap=support_gap, **kw)


def approx_kl_sum(logp, old_logp, mask):  # [B, T] x3 -> scalar: sum of k3 KL(old || new) terms
  """Schulman's k3 estimator, (r - 1) - log r with r = pi / pi_old, summed over masked tokens."""
  d = jnp.clip(jnp.where(mask, logp - old_logp, 0.0), -DEFAULT_MAX_LOG_RATIO, DEFAULT_MAX_LOG_RATIO)
  return jnp.sum(jnp.where(mask, jnp.expm1(d) - d, 0.0))


def explained_variance(values, returns, mask):  # [B, T] x3 -> scalar
  """1 - Var(R - V) / Var(R) over masked tokens (0 when the returns do not vary)."""
  mask = jnp.asarray(mask, bool)
  n = jnp.maximum(mask.sum(), 1)

  def var(x):
    mean = jnp.where(mask, x, 0.0).sum() / n
    return jnp.where(mask, (x - mean) ** 2, 0.0).sum() / n

  var_r = var(returns)
  return jnp.where(var_r > 0, 1.0 - var(returns - values) / jnp.where(var_r > 0, var_r, 1.0), 0.0)
