"""The jitted device steps every backend shares: prefill through a cache, and a chunk of decode steps.

Both are cache-agnostic (the dense and paged caches implement the same `attend`), so the backends
differ only in where KV lives and how sequences are scheduled, never in the math.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rl.rollout.sampling import sample, token_keys


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(
  graphdef,
  state,
  cache,
  tokens,  # [B, T] int32, right-padded
  positions,  # [B, T] int32
  last,  # [B] int32 index of each row's last real token
):  # -> ([B, V] f32 logits at `last`, cache)
  model = nnx.merge(graphdef, state)
  hidden, cache = model.forward_with_cache(tokens, positions, cache)
  h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
  return model.logits(h_last), cache


@jax.jit
def sample_first(
  logits,  # [B, V] f32 (a group's rows repeat its prompt's logits)
  base_keys,
  temperature,
  top_k,
  top_p,
):  # [B] each
  return sample(
    logits, token_keys(base_keys, jnp.zeros(logits.shape[:1], jnp.int32)), temperature, top_k, top_p
  )


@functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=2)
def decode_chunk(
  graphdef,
  state,
  cache,
  steps: int,
  tokens,  # [S] int32: each slot's last sampled token (not yet in the cache)
  positions,  # [S] int32: where that token goes
  generated,  # [S] int32: tokens generated so far (the draw index of the next one)
  budget,  # [S] int32: tokens the slot may still generate; 0 = idle slot
  stop_ids,  # [S, K] int32, -1 padded
  base_keys,
  temperature,
  top_k,
  top_p,  # [S] each
):  # -> ([steps, S] tokens, [steps, S] logprobs, [steps, S] bool emitted, cache)
  """`steps` decode steps. A slot stops emitting after a stop id or when its budget is spent; it keeps
  riding along (fixed shapes) without advancing, writing only at its own next, unused position."""
  model = nnx.merge(graphdef, state)

  def step(carry, _):
    cache, tok, pos, gen, left = carry
    active = left > 0
    hidden, cache = model.forward_with_cache(tok[:, None], pos[:, None], cache)
    logits = model.logits(hidden[:, 0])
    new, logp = sample(logits, token_keys(base_keys, gen), temperature, top_k, top_p)
    stopped = jnp.any(new[:, None] == stop_ids, axis=-1)
    left = jnp.where(active, jnp.where(stopped, 0, left - 1), 0)
    tok = jnp.where(active, new, tok)
    pos = jnp.where(active, pos + 1, pos)
    gen = jnp.where(active, gen + 1, gen)
    return (cache, tok, pos, gen, left), (new, logp, active)

  (cache, *_), (toks, logps, emitted) = jax.lax.scan(
    step, (cache, tokens, positions, generated, budget), None, length=steps
  )
  return toks, logps, emitted, cache


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(cache, src, dst):  # [M] int32 each: page src[i] -> page dst[i] in every layer
  return dataclasses.replace(
    cache,
    k=cache.k.at[:, :, dst].set(cache.k[:, :, src]),
    v=cache.v.at[:, :, dst].set(cache.v[:, :, src]),
  )
