"""``loss_scale=`` of the fused LM-head loss: the micro-batch's share of the global loss, checked as
:func:`kernels.grpo_loss` checks it. The op multiplies the reduction by it before the per-token
weights (and so the in-forward gradients) are formed, so the custom VJP's cotangent stays 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import checks


def checked_loss_scale(loss_scale):
  """loss_scale as an f32 scalar carrying no gradient (1 when None), checked as grpo_loss does."""
  if loss_scale is None:
    return jnp.float32(1.0)
  loss_scale = checks.as_array("loss_scale", loss_scale)
  if loss_scale.ndim != 0 or not jnp.issubdtype(loss_scale.dtype, jnp.number):
    raise checks.ArgumentTypeError(
      f"loss_scale must be a numeric scalar, got {loss_scale.dtype}{list(loss_scale.shape)}"
    )
  checks.finite("loss_scale", loss_scale)
  return jax.lax.stop_gradient(loss_scale.astype(jnp.float32))
