"""The definition: the GRPO loss of `hidden @ lm_head`, logits accumulated in float32."""

from __future__ import annotations

import jax.numpy as jnp

from kernels.grpo_loss.reference import grpo_loss_reference


def linear_logits(
  hidden,  # [..., H]
  lm_head,  # [H, V]
):  # -> [..., V] f32
  return jnp.einsum("...h,hv->...v", hidden, lm_head, preferred_element_type=jnp.float32)


def fused_linear_grpo_loss_reference(
  hidden,  # [B, T, H]
  lm_head,  # [H, V]
  completion_ids,  # [B, T] int
  completion_mask,  # [B, T]
  advantages,  # [B]
  **kwargs,
):
  """`grpo_loss_reference(hidden @ lm_head, ...)`: materialises the [B, T, V] f32 logits."""
  return grpo_loss_reference(
    linear_logits(hidden, lm_head), completion_ids, completion_mask, advantages, **kwargs
  )


def vocab_stats_reference(
  hidden,  # [N, H]
  lm_head,  # [H, V] one vocabulary shard
  ids,  # [N] int32 shard-local; outside [0, V) = not in this shard
  temperature: float = 1.0,
):
  """Per-row (lse, chosen z, found, E_softmax[z]) of z = hidden @ lm_head / temperature, all f32 [N].

  The statistics a vocabulary shard contributes; shards combine them exactly (see `combine_stats`).
  """
  z = linear_logits(hidden, lm_head) / temperature
  lse = jnp.log(jnp.sum(jnp.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
  hit = jnp.arange(z.shape[-1])[None, :] == ids[:, None]
  chosen = jnp.sum(jnp.where(hit, z, 0.0), -1)
  found = jnp.sum(hit, -1).astype(jnp.float32)
  ez = jnp.sum(jnp.exp(z - lse[:, None]) * z, -1)
  return lse, chosen, found, ez
