"""Token sampling on device: temperature, top-k, top-p, greedy, each row with its own settings and key.

Returns the log-probability of the drawn token under the distribution it was drawn from, which is what
an off-policy correction (or a check against a teacher-forced forward) needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def processed_logprobs(
  logits,  # [B, V] f32
  temperature,  # [B] f32; 0 = greedy (plain softmax)
  top_k,  # [B] int32; 0 = off
  top_p,  # [B] f32; 1 = off
):  # -> [B, V] f32 log-probs, -inf outside the kept set
  """The log-softmax of logits / temperature restricted to the top-k, then the top-p nucleus."""
  v = logits.shape[-1]
  t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
  z = logits.astype(jnp.float32) / t
  # One descending sort serves both filters: rank < k, and cumulative mass before a token < p.
  order = jnp.argsort(-z, axis=-1)
  zs = jnp.take_along_axis(z, order, axis=-1)
  rank = jnp.arange(v)[None, :]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
  keep_sorted = rank < k
  ps = jax.nn.softmax(jnp.where(keep_sorted, zs, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(ps, axis=-1) - ps
  keep_sorted &= (mass_before < top_p[:, None]) | (rank == 0)  # the top token is always kept
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
  return jax.nn.log_softmax(jnp.where(keep, z, -jnp.inf), axis=-1)


def sample(
  logits,  # [B, V] f32
  keys,  # [B] typed PRNG keys
  temperature,  # [B] f32
  top_k,  # [B] int32
  top_p,  # [B] f32
):  # -> ([B] int32 tokens, [B] f32 log-probs)
  logp = processed_logprobs(logits, temperature, top_k, top_p)
  drawn = jax.vmap(jax.random.categorical)(keys, logp)
  greedy = jnp.argmax(logits, axis=-1)
  tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
  plain = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.where(temperature[:, None] > 0, logp, plain)
  return tokens, jnp.take_along_axis(chosen, tokens[:, None], axis=-1)[:, 0]


def token_keys(
  base_keys,  # [B] typed keys: fold_in(key(seed), sample_index) per row
  steps,  # [B] int32: index of the token being drawn within the completion
):  # -> [B] typed keys
  return jax.vmap(jax.random.fold_in)(base_keys, steps)


def sample_base_keys(
  seeds, sample_indices
):  # [B] int, [B] int -> [B] typed keys (host-side inputs)
  return jax.vmap(lambda s, j: jax.random.fold_in(jax.random.key(s), j))(
    jnp.asarray(seeds, jnp.uint32), jnp.asarray(sample_indices, jnp.int32)
  )
