"""The sampled support in the loop (`train.score_sampled_support`): the trainer scores each sampled
token over the set the sampler drew it from (kernels.support), in the old, reference and current
log-probs, so the importance ratio carries no log(kept mass) bias.

The engines report each token's support gap (rl.rollout: paged and dense). sglang_jax cannot: the
trainer then *replays* the sampler's filter rule (rl.rollout.sampling.support_gaps: the same
threshold top-k / top-p / min-p, kernels.support.threshold) on the old policy's own logits, and moves
the engine's full-softmax log-probs onto that support (s - log kept mass), so the loss's importance
ratio compares the same distribution on both sides.

`support_pass` is that old-policy pass. It also gives the trainer's raw (full-softmax) and truncated
log-probs for the `mismatch/raw/*` and `mismatch/truncated/*` metrics (rl.mismatch.support_sums).

Every impl of `kernels.grpo_loss` and `kernels.fused_linear_grpo_loss` takes `support_gap=`: the loss
is called directly (rl.update, rl.agent.ppo).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.grpo_loss import token_logps_and_entropy
from rl.rollout.sampling import support_gaps

LOG = logging.getLogger(__name__)


@functools.cache  # once per process and engine
def say_replayed(engine: str) -> None:
  LOG.warning(
    "rl.support: the %s engine reports no support gaps; the trainer replays the sampler's "
    "top-k / top-p / min-p on the old policy's logits to form them (train.score_sampled_support)",
    engine,
  )


def gaps_in_use(cfg, vocab_size: int) -> bool:
  """Whether the run scores sampled tokens over their sampled support: the sampler filters and
  train.score_sampled_support is on."""
  return cfg.train.score_sampled_support and cfg.sampling.filters(vocab_size)


def replay_of(sampling) -> tuple[int, float, float]:  # a SamplingSection -> support_pass's replay
  return (sampling.top_k, sampling.top_p, sampling.min_p)


def batch_gaps(
  cfg,  # rl.config.GRPOConfig
  vocab_size: int,
  graphdef,
  params,  # the pre-update policy's
  reported,  # [K, M, C] f32: the engine's gaps (-inf off the sampled tokens), or None
  tokens,  # [K, M, T] int32
  attention_mask,  # [K, M, T] bool
  completion_len: int,
  completion_mask,  # [K, M, C] bool: the sampled tokens (an agent's MODEL tokens)
):  # -> [K, M, C] f32 or None
  """The gaps an update scores with: None unless `gaps_in_use`; the engine's when reported, else
  replayed on the policy's logits (said once)."""
  if not gaps_in_use(cfg, vocab_size):
    return None
  if reported is not None:
    return reported
  say_replayed(cfg.rollout.backend)
  s = cfg.sampling
  args = (graphdef, params, tokens, attention_mask, completion_len, s.temperature, replay_of(s))
  return support_pass(*args, None, completion_mask)[2]


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def support_pass(
  graphdef,
  params,
  tokens,  # [K, M, T] int32
  attention_mask,  # [K, M, T] bool
  completion_len: int,  # C
  temperature: float,
  replay: tuple[int, float, float] | None,  # (top_k, top_p, min_p): replay the gaps; None: given
  gaps=None,  # [K, M, C] f32: the engine's support gaps (replay None)
  completion_mask=None,  # [K, M, C] bool: the tokens that have a gap (None: the completion's)
):  # -> ([K, M, C] truncated log-probs, [K, M, C] raw log-probs, [K, M, C] gaps)
  """The old policy's log-probs of the completion tokens, over each token's sampled support and
  over the full softmax (0 where masked), and the gaps used (-inf where masked): the engine's, or
  with `replay` the sampler's filter applied to these logits."""
  model = nnx.merge(graphdef, params)
  c = completion_len

  def one(_, mb):
    t, a, g, cm = mb
    ids, mask = t[:, -c:], (a[:, -c:] if cm is None else cm)  # rl.update's row layout
    logits = model.logits(model(t, a)[:, -c - 1 : -1])  # [M, C, V] f32
    if replay is not None:
      n = ids.size
      full = lambda x, dt=jnp.float32: jnp.full((n,), x, dt)
      top_k, top_p, min_p = replay
      g = support_gaps(
        logits.reshape(n, -1),
        ids.reshape(n),
        full(temperature),
        full(top_k, jnp.int32),
        full(top_p),
        full(min_p),
      ).reshape(ids.shape)
    g = jnp.where(mask, g, -jnp.inf)
    safe = jnp.where(mask, ids, 0)
    raw, _ = token_logps_and_entropy(logits, safe, temperature)
    truncated, _ = token_logps_and_entropy(logits, safe, temperature, g)
    return None, (jnp.where(mask, truncated, 0.0), jnp.where(mask, raw, 0.0), g)

  return jax.lax.scan(one, None, (tokens, attention_mask, gaps, completion_mask))[1]
