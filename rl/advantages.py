"""Group-relative advantages: each completion's reward against the other samples of its prompt."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["advantage_stats", "group_advantages"]


def group_advantages(
  rewards,  # [G * n] f32, the n samples of each prompt contiguous
  group_size: int,
  *,
  eps: float = 1e-4,
  scale: bool = True,
  ddof: int = 1,
):  # -> [G * n] f32
  """`(r - mean_group) / (std_group + eps)`; `scale=False` gives `r - mean_group` (Dr. GRPO).

  A group whose rewards are all equal gets advantage 0 for every sample (it carries no learning signal).
  `ddof=1` is the sample standard deviation, as TRL computes it; groups need >= 2 samples for it.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1:
    raise ValueError(
      f"rewards must be a flat [groups * group_size] array, got shape {rewards.shape}"
    )
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
  if scale and group_size <= ddof:
    raise ValueError(
      f"group_size={group_size} is too small for a std with ddof={ddof}: GRPO needs "
      "several samples per prompt"
    )
  r = rewards.reshape(-1, group_size)
  centred = r - r.mean(axis=1, keepdims=True)
  if scale:
    std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / (group_size - ddof))
    # Zero-variance groups give exactly 0 whatever eps is (0 / 0 would be NaN with eps = 0).
    centred = jnp.where(std > 0, centred / jnp.where(std > 0, std + eps, 1.0), 0.0)
  return centred.reshape(-1)


def advantage_stats(rewards, advantages, group_size: int) -> dict[str, float]:
  """Logged per step: advantage spread and how many groups carried no signal."""
  r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
  a = jnp.asarray(advantages, jnp.float32)
  flat = r.max(axis=1) == r.min(axis=1)
  return {
    "advantage/mean": float(a.mean()),
    "advantage/std": float(a.std()),
    "advantage/min": float(a.min()),
    "advantage/max": float(a.max()),
    "advantage/zero_std_group_fraction": float(flat.mean()),
  }
