"""rl.agent's update math: the pre-update pass (the policy's log-probs and the critic's values,
micro-batch by micro-batch) and one optimizer step of the policy (and, for train.algorithm=ppo, the
value head) on the global [K, M, ...] batch of packed episodes. The policy term is
`rl.agent.ppo.policy_loss` (kernels.grpo_loss semantics with per-token advantages); the value head is
trained with the clipped value loss, weighted by train.vf_coef, in the same micro-batched,
gradient-accumulated update. `compile_update` jits it at one completion width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kernels.grpo_loss import token_logps_and_entropy
from rl import kernel_sharding, mismatch
from rl.agent import ppo
from rl.agent.critic import critic_values
from rl.config import GRPOConfig
from rl.optimizer import _all_finite, _global_norm, guarded_step, shardings_of
from rl.update import completion_hidden


class AgentBatch(NamedTuple):
  """One step's rows as [K, M, ...] (accumulation step, sequence); C = the completion width."""

  tokens: jax.Array  # [K, M, P + C] int32
  attention_mask: jax.Array  # [K, M, P + C] bool
  model_mask: jax.Array  # [K, M, C] bool, the trained tokens
  advantages: jax.Array  # [K, M, C] f32
  old_logps: jax.Array  # [K, M, C] f32, the policy before this step's first epoch
  old_values: jax.Array  # [K, M, C] f32
  returns: jax.Array  # [K, M, C] f32 (value targets; zeros for grpo)
  ref_logps: jax.Array | None = None  # [K, M, C] f32, the reference policy's (train.beta > 0)
  # [K, M, C] f32: MODEL tokens' support gaps, -inf on an environment's tokens (rl.support); None:
  # the full softmax (the sampler does not filter, or train.score_sampled_support is off)
  support_gaps: jax.Array | None = None


def _forward(graphdef, params, critic, tokens, attention_mask, completion_len, remat="none"):
  model = nnx.merge(graphdef, params)
  hidden = completion_hidden(model, tokens, attention_mask, completion_len, remat)
  return model, hidden, critic_values(critic, hidden, tokens, attention_mask, completion_len)


@functools.partial(jax.jit, static_argnums=(0, 1, 5, 6))
def old_logps_and_values(graphdef, head_graphdef, params, head_params, batch, completion_len, temp):
  """The pre-update policy's log-probs and the critic's values, micro-batch by micro-batch:
  ([K, M, C], [K, M, C], [K, M, C] or None). With support gaps the log-probs are over each token's
  sampled support and the third output is the full softmax's (for mismatch/raw/*); else None."""
  head = nnx.merge(head_graphdef, head_params)

  def one(_, mb):
    tokens, attn, mask, gap = mb
    model, hidden, values = _forward(graphdef, params, head, tokens, attn, completion_len)
    ids, logits = jnp.where(mask, tokens[:, -completion_len:], 0), model.logits(hidden)
    logp, _ = token_logps_and_entropy(logits, ids, temp, gap)
    raw = None if gap is None else token_logps_and_entropy(logits, ids, temp)[0]
    keep = lambda x: None if x is None else jnp.where(mask, x, 0.0)
    return None, (keep(logp), keep(values), keep(raw))

  xs = (batch.tokens, batch.attention_mask, batch.model_mask, batch.support_gaps)
  return jax.lax.scan(one, None, xs)[1]


@jax.jit
def pre_update_mismatch(
  sampler,  # [K, M, C] f32: the engine's log-probs on model tokens
  old,  # [K, M, C] f32: the pre-update pass's (over the sampled support with gaps)
  raw,  # [K, M, C] f32 or None: the full softmax's, with gaps
  mask,  # [K, M, C] bool: model tokens
  epsilons,  # (epsilon_low, epsilon_high): the tails of mismatch/{raw,truncated}/*
) -> dict[str, jax.Array]:
  """rl.mismatch's mismatch/* of the engine's log-probs against the pre-update pass, as rl.train
  reports them (raw and truncated ratios with a filtering sampler); jitted so that the sharded
  global arrays of a multi-process run reduce to replicated scalars."""
  flat = lambda x: x.reshape(-1, x.shape[-1])
  sums = mismatch.mismatch_sums(flat(sampler), flat(old), flat(mask))
  if raw is not None:
    sums |= mismatch.support_sums(flat(sampler), flat(raw), flat(old), flat(mask), *epsilons)
  return mismatch.finish(sums)


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
  completion_len: int
  algorithm: str
  loss_type: str
  epsilon_low: float
  epsilon_high: float
  temperature: float
  vf_coef: float
  value_clip: float | None
  impl: str
  fused_lm_head: bool
  beta: float = 0.0  # KL(pi || ref) weight; the batch then carries ref_logps
  # The loss kernels' layout over the run's mesh (rl.kernel_sharding.batch_sharding; None: one
  # device), as rl.update.LossSettings': a Pallas kernel in a program over several devices must run
  # shard-local. Hashable, compiled in.
  kernel_sharding: Any = None
  remat: str = "none"  # train.remat: what each policy layer keeps for the backward (rl.model.qwen)


def update_step(graphdef, head_graphdef, policy_opt, head_opt, s: UpdateSettings, state, batch):
  """One optimizer step of the policy (and, for ppo, the value head) on the global batch; the K
  micro-batch losses are scaled to sum to the global loss (as rl.update does). A non-finite loss or
  gradient norm keeps the old state."""
  params, head_params, opt_state, head_opt_state = state
  k = batch.tokens.shape[0]
  num_tokens = jnp.maximum(batch.model_mask.sum().astype(jnp.float32), 1.0)
  kernel_type, scale, items = {
    "grpo": ("grpo", 1.0 / k, None),
    "dr_grpo": ("dr_grpo", 1.0 / k, None),
    "bnpo": ("dapo", 1.0, num_tokens),
    "dapo": ("dapo", 1.0, num_tokens),
  }[s.loss_type]
  critic = s.algorithm == "ppo"

  def micro(grads, mb):
    def loss_fn(p, hp):
      head = nnx.merge(head_graphdef, hp)
      model, hidden, values = _forward(
        graphdef, p, head, mb.tokens, mb.attention_mask, s.completion_len, s.remat
      )
      fused = s.fused_lm_head
      pl, aux = ppo.policy_loss(
        hidden if fused else model.logits(hidden),
        mb.tokens[:, -s.completion_len :],
        mb.model_mask,
        mb.advantages,
        old_logps=mb.old_logps,
        ref_logps=mb.ref_logps,
        beta=s.beta,
        epsilon_low=s.epsilon_low,
        epsilon_high=s.epsilon_high,
        temperature=s.temperature,
        loss_type=kernel_type,
        max_completion_length=s.completion_len,
        num_items_in_batch=items,
        impl=s.impl,
        lm_head=model.lm_head_weight() if fused else None,
        support_gap=mb.support_gaps,
        sharding=s.kernel_sharding,
      )
      vl, vclipped = ppo.value_loss(values, mb.old_values, mb.returns, mb.model_mask, s.value_clip)
      vl = vl.sum() / num_tokens
      loss = pl * scale + (s.vf_coef * vl if critic else 0.0)
      sums = {
        "loss": loss,
        "policy_loss": pl * scale,
        "value_loss": vl,
        "value_clip_fraction": vclipped.sum() / num_tokens,
        "clip_fraction": aux.is_clipped.sum() / num_tokens,
        "approx_kl": ppo.approx_kl_sum(aux.per_token_logps, mb.old_logps, mb.model_mask)
        / num_tokens,
        "entropy": aux.entropy.sum() / num_tokens,
        "kl": aux.per_token_kl.sum() / num_tokens,
      }
      return loss, sums

    (_, sums), g = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, head_params)
    return jax.tree.map(jnp.add, grads, g), sums

  zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), t)
  (g_params, g_head), sums = jax.lax.scan(micro, (zeros(params), zeros(head_params)), batch)
  metrics = {key: v.sum() for key, v in sums.items()}
  grad_norm = _global_norm((g_params, g_head) if critic else g_params)
  g_params = jax.tree.map(lambda g, p: g.astype(p.dtype), g_params, params)
  new_head, new_head_opt = head_params, head_opt_state
  if critic:
    updates, new_head_opt = head_opt.update(g_head, head_opt_state, head_params)
    new_head = optax.apply_updates(head_params, updates)
  # the head's new weights join the inputs' check; the policy's step: rl.optimizer.guarded_step
  inputs_ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & _all_finite(new_head)
  new_params, new_opt, finite = guarded_step(policy_opt, params, g_params, opt_state, inputs_ok)
  keep = lambda new, old: jnp.where(finite, new, old)
  new_head, new_head_opt = jax.tree.map(
    keep, (new_head, new_head_opt), (head_params, head_opt_state)
  )
  state = (new_params, new_head, new_opt, new_head_opt)
  metrics["grad_norm"] = grad_norm
  metrics["nonfinite"] = jnp.logical_not(finite).astype(jnp.float32)
  return state, metrics


def head_optimizer(cfg: GRPOConfig) -> optax.GradientTransformation:
  """The critic's optimizer: AdamW on the policy's learning-rate schedule (rl.agent.step.AgentStep
  trains the critic with it; rl.aot.programs compiles the same update for --check)."""
  from rl.run.setup import learning_rate_schedule

  tcfg = cfg.train
  rate = learning_rate_schedule(tcfg, tcfg.learning_rate, tcfg.steps)
  return optax.adamw(rate, weight_decay=tcfg.weight_decay)


def update_settings(cfg: GRPOConfig, impl: str, completion_len: int, mesh=None) -> UpdateSettings:
  """The config's update settings at completion width `completion_len` (`impl`: the loss impl the
  platform has, rl.config.platform.loss_impl) for a run on `mesh`."""
  tcfg = cfg.train
  return UpdateSettings(
    completion_len, tcfg.algorithm, tcfg.loss_type, tcfg.epsilon_low, tcfg.epsilon_high,
    cfg.sampling.temperature, tcfg.vf_coef, tcfg.value_clip, impl, tcfg.fused_lm_head, tcfg.beta,
    kernel_sharding.batch_sharding(mesh), tcfg.remat,
  )  # fmt: skip


def compile_update(graphdef, head_graphdef, policy_opt, head_opt, settings: UpdateSettings, state):
  """`update_step` jitted over (state, batch), the state donated and kept in `state`'s layout step
  after step."""
  return jax.jit(
    functools.partial(update_step, graphdef, head_graphdef, policy_opt, head_opt, settings),
    donate_argnums=(0,),
    out_shardings=(shardings_of(state), None),
  )
