"""Training-inference mismatch: how far the rollout engine's log-probs of the sampled tokens (the
sampler's, `s`) are from the trainer's (`old`: its own forward of the same weights and tokens).

With r = old - s per completion token (masked tokens only):
  * ``mismatch/abs_log_ratio_mean``, ``mismatch/abs_log_ratio_max``: mean and max of |r|;
  * ``mismatch/k3_kl``: KL(sampler || trainer) by Schulman's k3 estimator, mean of exp(r) - r - 1 over
    tokens drawn from the sampler (unbiased, never negative);
  * ``mismatch/exp_abs_log_ratio_mean``: mean of exp|r| (the figure tunix users asked for; 1 = none);
  * with the loss's importance weights w (`is_weight`): ``mismatch/is_weight_mean``, and
    ``mismatch/masked_or_truncated_fraction``, the fraction of tokens whose weight is not their ratio
    rho (token modes: rho = exp(r); sequence modes: exp of the sequence's masked sum of r), i.e. the
    weight was truncated to the cap or masked to 0.
With a filtering sampler (rl.support), the trainer's log-probs both over the full softmax ("raw") and
over each token's sampled support ("truncated"), each against the sampler's, as ratios rho = exp(r):
  * ``mismatch/{raw,truncated}/ratio_mean``: the mean of rho (the bias: log(kept mass) on the raw side);
  * ``.../below_fraction``, ``.../above_fraction``: the tails, rho < 1 - epsilon_low and
    rho > 1 + epsilon_high (the loss's clip range);
  * ``.../k3_kl``: as above.
A batch with no completion token reports no mismatch (0, and 1 for the exp / weight means).

The loop computes the statistics per micro-batch inside the compiled step: `mismatch_sums` gives
additive sums (and a max) that `reduce_sums` combines across micro-batches and `finish` turns into
the metrics; `mismatch_metrics` is the one-batch composition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PREFIX = "mismatch/"
# |r| is saturated here before exp: a stale or broken sampler reports a huge, finite figure (exp(60)
# summed over 1e9 tokens still fits f32) instead of inf.
MAX_ABS_LOG_RATIO = 60.0
# A weight counts as its ratio when their logs agree to this (f32 rounding of the loss's own exp /
# sum of the same log-ratios is ~1e-6; a weight truncated to within 0.1 % of its ratio is not counted).
LOG_WEIGHT_RTOL = 1e-3
IS_LEVELS = ("token", "sequence")


def mismatch_sums(
  sampler_logps,  # [B, T] f32: the rollout engine's log-probs of the sampled tokens
  trainer_logps,  # [B, T] f32: the trainer's log-probs of the same tokens (the loss's `old`)
  mask,  # [B, T] bool: completion tokens
  is_weight=None,  # [B, T] f32: the loss's importance weights (aux.is_weight), or None
  *,
  is_level: str = "token",  # how the weights' ratio was formed: per "token" or per "sequence"
) -> dict[str, jax.Array]:  # [] f32 each
  """Additive sums over the batch's masked tokens (``*_max``: a max), for `reduce_sums` / `finish`."""
  if is_level not in IS_LEVELS:
    raise ValueError(f"is_level must be one of {IS_LEVELS}, got {is_level!r}")
  s = jnp.asarray(sampler_logps, jnp.float32)
  old = jnp.asarray(trainer_logps, jnp.float32)
  m = jnp.asarray(mask, jnp.bool_)
  if not s.shape == old.shape == m.shape or s.ndim != 2:
    raise ValueError(
      f"sampler_logps {s.shape}, trainer_logps {old.shape} and mask {m.shape} must be one [B, T] shape"
    )
  r = jnp.where(m, old - s, 0.0)  # masked tokens: no mismatch, and never a padded inf / NaN
  rc = jnp.clip(r, -MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
  total = lambda x: jnp.sum(jnp.where(m, x, 0.0))
  out = {
    "tokens": total(jnp.ones_like(r)),
    "abs_log_ratio": total(jnp.abs(r)),
    "abs_log_ratio_max": jnp.max(jnp.abs(r), initial=0.0),
    # expm1(r) - r: exact near r = 0, where exp(r) - r - 1 would cancel to rounding noise
    "k3_kl": total(jnp.expm1(rc) - rc),
    "exp_abs_log_ratio": total(jnp.exp(jnp.abs(rc))),
  }
  if is_weight is not None:
    w = jnp.asarray(is_weight, jnp.float32)
    if w.shape != m.shape:
      raise ValueError(f"is_weight {w.shape} must have mask's shape {m.shape}")
    log_rho = r if is_level == "token" else jnp.sum(r, axis=1, keepdims=True) + jnp.zeros_like(r)
    log_w = jnp.log(jnp.maximum(w, 0.0))  # a masked weight (0): -inf, never equal to its ratio
    differs = ~(jnp.abs(log_w - log_rho) <= LOG_WEIGHT_RTOL)
    out["is_weight"] = total(w)
    out["masked_or_truncated"] = total(differs.astype(jnp.float32))
  return out


SUPPORT_SIDES = ("raw", "truncated")


def support_sums(
  sampler_logps,  # [B, T] f32: the rollout engine's log-probs
  raw_logps,  # [B, T] f32: the trainer's, over the full softmax
  truncated_logps,  # [B, T] f32: the trainer's, over each token's sampled support
  mask,  # [B, T] bool
  epsilon_low: float,
  epsilon_high: float,
) -> dict[str, jax.Array]:  # "<side>/<name>" -> [] f32 sums
  """Additive sums of the raw and truncated ratios' statistics (module docstring), for `finish`."""
  s = jnp.asarray(sampler_logps, jnp.float32)
  m = jnp.asarray(mask, jnp.bool_)
  total = lambda x: jnp.sum(jnp.where(m, x, 0.0))
  out = {}
  for side, trainer in zip(SUPPORT_SIDES, (raw_logps, truncated_logps)):
    r = jnp.where(m, jnp.asarray(trainer, jnp.float32) - s, 0.0)
    rc = jnp.clip(r, -MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    rho = jnp.exp(rc)
    out[f"{side}/ratio"] = total(rho)
    out[f"{side}/below"] = total((rho < 1.0 - epsilon_low).astype(jnp.float32))
    out[f"{side}/above"] = total((rho > 1.0 + epsilon_high).astype(jnp.float32))
    out[f"{side}/k3_kl"] = total(jnp.expm1(rc) - rc)
  return out


def reduce_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Sums stacked over micro-batches ([K] each, e.g. from a scan) -> one batch's sums ([] each)."""
  return {k: jnp.max(v) if k.endswith("_max") else jnp.sum(v) for k, v in sums.items()}


def finish(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The ``mismatch/*`` metrics from one batch's sums."""
  n = sums["tokens"]
  mean = lambda key, empty: jnp.where(n > 0, sums[key] / jnp.maximum(n, 1.0), empty)
  out = {
    "abs_log_ratio_mean": mean("abs_log_ratio", 0.0),
    "abs_log_ratio_max": sums["abs_log_ratio_max"],
    "k3_kl": mean("k3_kl", 0.0),
    "exp_abs_log_ratio_mean": mean("exp_abs_log_ratio", 1.0),
  }
  if "is_weight" in sums:
    out["is_weight_mean"] = mean("is_weight", 1.0)
    out["masked_or_truncated_fraction"] = mean("masked_or_truncated", 0.0)
  for side in SUPPORT_SIDES:
    if f"{side}/ratio" in sums:
      out[f"{side}/ratio_mean"] = mean(f"{side}/ratio", 1.0)
      out[f"{side}/below_fraction"] = mean(f"{side}/below", 0.0)
      out[f"{side}/above_fraction"] = mean(f"{side}/above", 0.0)
      out[f"{side}/k3_kl"] = mean(f"{side}/k3_kl", 0.0)
  return {PREFIX + k: v for k, v in out.items()}


def mismatch_metrics(
  sampler_logps,  # [B, T] f32
  trainer_logps,  # [B, T] f32
  mask,  # [B, T] bool
  is_weight=None,  # [B, T] f32 or None
  *,
  is_level: str = "token",
) -> dict[str, jax.Array]:  # "mismatch/<name>" -> [] f32
  """The ``mismatch/*`` metrics of one batch (see the module docstring)."""
  return finish(mismatch_sums(sampler_logps, trainer_logps, mask, is_weight, is_level=is_level))
