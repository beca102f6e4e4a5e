"""Tunix's GRPO aux metrics (``grpo_loss_fn``'s aux dict, 0.1.7) from our per-token log-probs.

Every entry is [B, T] arithmetic on ``aux.per_token_logps`` / ``aux.entropy`` (no gradient), written
with tunix's own helpers (``masked_mean``, ``aggregate_loss``, ``compute_kl_divergence``), so the
learner's logs (``kl``, ``pg_clipfrac``, ...) read what tunix's built-in loss would report.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from tunix.rl import algo_core, common

from kernels.integrations.tunix.options import GSPO_TOKEN_CAP


def _masked_extreme(x, mask, fn, fill):  # [B, T] -> scalar
  return fn(jnp.where(mask > 0, x, fill))


def tunix_metrics(
  logp,  # [B, T] f32, our per-token log-probs (0 at masked positions)
  entropy,  # [B, T] f32
  mask,  # [B, T] int / float, tunix's completion_mask
  advantages,  # [B] or [B, T], without sampler weights
  old_logps,  # [B, T] or None
  ref_logps,  # [B, T] or None
  weights,  # [B, T] or None: sampler_is_weights
  algo_config,
) -> dict:
  """The aux dict of tunix's grpo_loss_fn, entry by entry (same keys, same formulas)."""
  logp, entropy = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(entropy)
  mode = algo_config.loss_agg_mode
  eps = algo_config.epsilon
  eps_high = getattr(algo_config, "epsilon_high", eps)
  eps_c = getattr(algo_config, "epsilon_c", None)
  log_ratio = logp - (logp if old_logps is None else old_logps.astype(jnp.float32))
  ppo_kl = algo_core.masked_mean(-log_ratio, mask)
  log_ratio = jnp.clip(log_ratio, -20.0, 20.0)
  if algo_config.loss_algo == "gspo-token":
    seq = (log_ratio * mask).sum(-1) / jnp.clip(mask.sum(-1), min=1)
    log_ratio = jnp.clip(jnp.broadcast_to(seq[:, None], logp.shape), max=GSPO_TOKEN_CAP)
  ratio = jnp.exp(log_ratio)
  adv = jnp.asarray(advantages, jnp.float32)
  adv = adv if adv.ndim == 2 else adv[:, None]
  pg1, pg2 = -adv * ratio, -adv * jnp.clip(ratio, 1 - eps, 1 + eps_high)
  per_token = jnp.maximum(pg1, pg2)
  pg3 = per_token if eps_c is None else -eps_c * adv
  lower = ((per_token > pg3) & (adv < 0.0)).astype(jnp.float32)
  per_token = jnp.where(adv < 0.0, jnp.minimum(pg3, per_token), per_token)
  if weights is not None:
    per_token = per_token * weights.astype(jnp.float32)
  adv_b = jnp.broadcast_to(adv, mask.shape)
  aux = {
    "kl": jnp.float32(0.0),
    "kl_loss": jnp.float32(0.0),
    "pg_loss": common.aggregate_loss(per_token, mask, mode),
    "pg_clipfrac": algo_core.masked_mean(jnp.greater(pg2, pg1), mask),
    "ppo_kl": ppo_kl,
    "pg_clipfrac_lower": common.aggregate_loss(lower, mask, mode),
    "is_ratio/mean": algo_core.masked_mean(ratio, mask),
    "is_ratio/max": _masked_extreme(ratio, mask, jnp.max, 0.0),
    "is_ratio/min": _masked_extreme(ratio, mask, jnp.min, jnp.inf),
    "log_ratio/abs_mean": algo_core.masked_mean(jnp.abs(log_ratio), mask),
    "pg_loss/unclipped_mean": algo_core.masked_mean(pg1, mask),
    "pg_loss/clipped_mean": algo_core.masked_mean(pg2, mask),
    "advantage/abs_mean": algo_core.masked_mean(jnp.abs(adv_b), mask),
    "advantage/max": _masked_extreme(adv_b, mask, jnp.max, -jnp.inf),
    "advantage/min": _masked_extreme(adv_b, mask, jnp.min, jnp.inf),
    "advantage/nonzero_frac": algo_core.masked_mean(
      (jnp.abs(adv_b) > 1e-8).astype(jnp.float32), mask
    ),
  }
  if weights is not None:
    w = weights.astype(jnp.float32)
    aux["sampler_is/weight_mean"] = algo_core.masked_mean(w, mask)
    aux["sampler_is/weight_min"] = _masked_extreme(w, mask, jnp.min, jnp.inf)
  else:
    aux["sampler_is/weight_mean"] = jnp.float32(1.0)
    aux["sampler_is/weight_min"] = jnp.float32(1.0)
  if ref_logps is not None:
    kl = common.compute_kl_divergence(
      logp, ref_logps, algo_config.kl_loss_mode, clamp_value=algo_config.kl_clamp_value
    )
    aux["kl"] = ((kl * mask).sum() / jnp.clip(mask.sum(), min=1)).astype(jnp.float32)
    aux["kl_loss"] = common.aggregate_loss(kl, mask, mode)
  aux["entropy"] = common.aggregate_loss(entropy, mask, mode)
  return aux


def ppo_metrics(
  logp,  # [B, T] f32, our per-token log-probs (0 at masked positions)
  mask,  # [B, T] int / float, tunix's completion_mask
  advantages,  # [B, T] f32, per-token (GAE)
  old_logps,  # [B, T] or None
  ref_logps,  # [B, T] or None
  spec,  # kernels.LossSpec of the loss (its clip range, dual clip and ratio clamp)
  kl: bool,  # the k1 KL term is on
) -> dict:
  """The aux dict of tunix's ppo_policy_loss_fn (``pg_clipfrac``, ``pg_clipfrac_lower``, and ``kl``
  when the KL term is on; the caller adds ``loss/entropy``), with tunix's masked_mean. The ratio is
  clamped as the loss clamps it (identical flags below 20 nats)."""
  logp = jax.lax.stop_gradient(logp)
  bound = spec.max_log_ratio if spec.max_log_ratio is not None else jnp.inf
  old = logp if old_logps is None else old_logps.astype(jnp.float32)
  ratio = jnp.exp(jnp.clip(logp - old, -bound, bound))
  adv = jnp.asarray(advantages, jnp.float32)
  pg1 = -ratio * adv
  pg2 = -jnp.clip(ratio, 1 - spec.epsilon_low, 1 + spec.epsilon_high) * adv
  per_token = jnp.maximum(pg1, pg2)
  pg3 = per_token if spec.epsilon_c is None else -spec.epsilon_c * adv
  lower = ((per_token > pg3) & (adv < 0.0)).astype(jnp.float32)
  aux = {
    "pg_clipfrac": algo_core.masked_mean(jnp.greater(pg2, pg1), mask),
    "pg_clipfrac_lower": algo_core.masked_mean(lower, mask),
  }
  if kl:
    aux["kl"] = algo_core.masked_mean(common.compute_kl_divergence(logp, ref_logps, "kl"), mask)
  return aux
