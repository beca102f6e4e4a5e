"""Shared pieces of the loss tests' random problems."""

import jax.numpy as jnp


def policy_kwargs(rng, logp, options: dict, *, off_policy: bool, beta: float) -> dict:
  """The loss keywords: `options`, `beta`, and old / reference log-probs near the current `logp` [B, T]
  (a realistic off-policy gap), drawn from `rng` only when asked for."""
  near = lambda: jnp.asarray(logp + rng.normal(scale=0.25, size=logp.shape), jnp.float32)  # noqa: E731
  kw = dict(options, beta=beta)
  if off_policy:
    kw["old_logps"] = near()
  if beta:
    kw["ref_logps"] = near()
  return kw
