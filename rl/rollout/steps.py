"""The jitted device steps every backend shares: prefill through a cache, and a chunk of decode steps.

Both are cache-agnostic (the dense and paged caches implement the same `attend`), so the backends
differ only in where KV lives and how sequences are scheduled, never in the math.

Byte discipline (bench/rollout/byte_account.py measures it): the steps take the weights already in the
compute dtype (`rollout_weights`, once per generate, i.e. per weight sync) so no step re-reads the f32
master weights and casts them; the cache is donated and updated in place; the sampler is the plain
log-softmax + Gumbel pass unless a row of the chunk filters (`filtered`, static), so the default GRPO
chunk carries no top-k / sort branch.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rl.rollout.sampling import BLOCK, no_gaps, sample, sample_blocked, token_keys


def precision_scope(precision: str | None):
  """`jax.default_matmul_precision(precision)` around tracing (None: the backend's default). Part of
  jit's cache key, so a step traced under one precision is never reused under another."""
  return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


@functools.partial(jax.jit, static_argnums=1)
def rollout_weights(state, dtype):  # nnx.State -> the same tree, floating leaves in `dtype`
  """The weights as every decode step reads them: the model casts each weight to its compute dtype
  at use, so holding them cast changes no value and saves the cast in every step (an f32 -> bf16
  convert of all weights per token on CPU, a read of f32 instead of bf16 weights everywhere)."""
  return jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
  )


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


@functools.partial(jax.jit, static_argnums=6)
def sample_first(
  logits,  # [B, V] f32 (a group's rows repeat its prompt's logits)
  base_keys,
  temperature,
  top_k,
  top_p,
  min_p,
  filtered: bool | None = None,
):  # -> ([B] tokens, [B] log-probs, [B] support gaps)
  keys = token_keys(base_keys, jnp.zeros(logits.shape[:1], jnp.int32))
  return sample(logits, keys, temperature, top_k, top_p, min_p, filtered)


def next_tokens(
  model,
  hidden,  # [S, H]: each slot's last hidden state
  keys,  # [S] typed PRNG keys
  temperature,
  top_k,
  top_p,
  min_p,  # [S] each
  filtered: bool | None,
):  # -> ([S] int32 tokens, [S] f32 log-probs, [S] f32 support gaps)
  """One decode step's draw. Unfiltered (the GRPO default), with a tied head and BLOCK dividing the
  vocabulary, from logits the LM head writes in blocks (`blocked_logits`); else from [S, V] logits.
  An untied head's [H, V] kernel cut into blocks would be relaid out in memory every step on TPU
  (Qwen2.5-7B: a 1.09 GB copy of the kernel read and written), where the logits' relayout costs
  4 x S x V x 4 bytes: less below S = H / 4 slots."""
  cfg = model.cfg
  if filtered is False and cfg.tie_word_embeddings and cfg.vocab_size % BLOCK == 0:
    tokens, logps = sample_blocked(model.blocked_logits(hidden, BLOCK), keys, temperature)
    return tokens, logps, no_gaps(hidden.shape[0])
  return sample(model.logits(hidden), keys, temperature, top_k, top_p, min_p, filtered)


@functools.partial(jax.jit, static_argnums=(0, 3, 4), donate_argnums=2)
def decode_chunk(
  graphdef,
  state,
  cache,
  steps: int,
  filtered: bool | None,  # static: some row filters (top-k / top-p / min-p); None: on device
  tokens,  # [S] int32: each slot's last sampled token (not yet in the cache)
  positions,  # [S] int32: where that token goes
  generated,  # [S] int32: tokens generated so far (the draw index of the next one)
  budget,  # [S] int32: tokens the slot may still generate; 0 = idle slot
  stop_ids,  # [S, K] int32, -1 padded
  base_keys,
  temperature,
  top_k,
  top_p,  # [S] each
  min_p=None,  # [S] f32, or None: off in every row
):  # -> ([steps, S] tokens, [steps, S] logprobs, [steps, S] gaps, [steps, S] bool emitted, cache)
  """`steps` decode steps. A slot stops emitting after a stop id or when its budget is spent; it keeps
  riding along (fixed shapes) without advancing, writing only at its own next, unused position.
  Each token comes with its log-prob and support gap (rl.rollout.sampling.sample)."""
  model = nnx.merge(graphdef, state)
  min_p = jnp.zeros_like(temperature) if min_p is None else min_p

  def step(carry, _):
    cache, tok, pos, gen, left = carry
    active = left > 0
    hidden, cache = model.forward_with_cache(tok[:, None], pos[:, None], cache)
    keys = token_keys(base_keys, gen)
    new, logp, gap = next_tokens(
      model, hidden[:, 0], keys, temperature, top_k, top_p, min_p, filtered
    )
    stopped = jnp.any(new[:, None] == stop_ids, axis=-1)
    left = jnp.where(active, jnp.where(stopped, 0, left - 1), 0)
    tok = jnp.where(active, new, tok)
    pos = jnp.where(active, pos + 1, pos)
    gen = jnp.where(active, gen + 1, gen)
    return (cache, tok, pos, gen, left), (new, logp, gap, active)

  (cache, *_), (toks, logps, gaps, emitted) = jax.lax.scan(
    step, (cache, tokens, positions, generated, budget), None, length=steps
  )
  return toks, logps, gaps, emitted, cache


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(cache, src, dst):  # [M] int32 each: page src[i] -> page dst[i] in every layer
  return cache.copy_pages(src, dst)
