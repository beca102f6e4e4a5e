"""Multi-turn RL: `python -m rl.agent --config configs/cpu-multiturn.yaml [key.sub=value ...]`.

A step: `prompts_per_step` environment seeds x `group_size` episodes each, rolled out turn by turn
(rl.rollout.multiturn) -> packed rows whose loss mask holds only model tokens -> advantages:
  * train.algorithm=grpo: each episode's return, normalised within its seed's group, on every model
    token of the episode;
  * train.algorithm=ppo: GAE over model tokens (rl.ppo) from the value head's (rl.critic) values of the
    pre-update forward, optionally whitened; the value head is trained with the clipped value loss,
    weighted by train.vf_coef, in the same micro-batched, gradient-accumulated update as the policy.
The policy term is `rl.ppo.policy_loss` (kernels.grpo_loss semantics with per-token advantages).

Everything else (model, tokenizer, data, engine, SFT warm-up, metrics writer, checkpoints, non-finite
guard, `--resume`, the reference policy of train.beta > 0) is rl.train.Trainer's; checkpoints add the
critic and its optimizer state. Several processes (dist.initialize=true) split a step's environment
seeds and eval's layouts between them, as rl.train splits prompts; the update runs on the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kernels.backend import host_platform
from kernels.grpo_loss import token_logps_and_entropy
from rl import platform, ppo, setup, sharding, train
from rl.advantages import group_advantages
from rl.config import GRPOConfig
from rl.configlib import ConfigError
from rl.critic import CriticModel, ValueHead, critic_values
from rl.env import CalcEnv, Environment, GridEnv
from rl.evaluate import process_slice
from rl.metrics import step_time_metrics
from rl.model import init_model, preset
from rl.rollout import SamplingParams
from rl.rollout.multiturn import (
  EPISODE_METRICS,
  episode_rows,
  observation_tokens,
  pack_episodes,
  rollout,
)
from rl.tokenizer import IM_END, chatml
from rl.update import (
  batch_token_logps,
  completion_hidden,
  init_optimizer_state,
  make_optimizer,
  shardings_of,
)

GRID_SYSTEM = "Walk @ to G on the ice, avoiding holes H. Reply with one move."
# Grid warm-up layouts come from seeds above the steps' (< 2**31) and eval's (2**31 + i).
GRID_WARMUP_SEEDS = 2**32
WIDTH_BUCKET = 32  # packed widths are rounded up to this: a handful of compiled shapes per run


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


def _forward(graphdef, params, critic, tokens, attention_mask, completion_len):
  model = nnx.merge(graphdef, params)
  hidden = completion_hidden(model, tokens, attention_mask, completion_len)
  return model, hidden, critic_values(critic, hidden, tokens, attention_mask, completion_len)


@functools.partial(jax.jit, static_argnums=(0, 1, 5, 6))
def old_logps_and_values(graphdef, head_graphdef, params, head_params, batch, completion_len, temp):
  """The pre-update policy's log-probs and the critic's values, micro-batch by micro-batch:
  ([K, M, C], [K, M, C])."""
  head = nnx.merge(head_graphdef, head_params)

  def one(_, mb):
    tokens, attn, mask = mb
    model, hidden, values = _forward(graphdef, params, head, tokens, attn, completion_len)
    ids = tokens[:, -completion_len:]
    logp, _ = token_logps_and_entropy(model.logits(hidden), jnp.where(mask, ids, 0), temp)
    return None, (jnp.where(mask, logp, 0.0), jnp.where(mask, values, 0.0))

  return jax.lax.scan(one, None, (batch.tokens, batch.attention_mask, batch.model_mask))[1]


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
        graphdef, p, head, mb.tokens, mb.attention_mask, s.completion_len
      )
      ids = mb.tokens[:, -s.completion_len :]
      fused = s.fused_lm_head
      pl, aux = ppo.policy_loss(
        hidden if fused else model.logits(hidden),
        ids,
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
  grad_norm = _norm((g_params, g_head) if critic else g_params)
  g_params = jax.tree.map(lambda g, p: g.astype(p.dtype), g_params, params)
  new_params, new_opt = policy_opt.step(params, g_params, opt_state)
  new_head, new_head_opt = head_params, head_opt_state
  if critic:
    updates, new_head_opt = head_opt.update(g_head, head_opt_state, head_params)
    new_head = optax.apply_updates(head_params, updates)
  new_state = (new_params, new_head, new_opt, new_head_opt)
  finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
  finite &= jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_state[:2])]))
  state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
  metrics["grad_norm"] = grad_norm
  metrics["nonfinite"] = jnp.logical_not(finite).astype(jnp.float32)
  return state, metrics


def _norm(tree):  # optax >= 0.2.5 has optax.tree.norm; global_norm warns there
  tree_ns = getattr(optax, "tree", None)
  return tree_ns.norm(tree) if hasattr(tree_ns, "norm") else optax.global_norm(tree)


EnvFactory = Callable[[], Environment]


class AgentTrainer(train.Trainer):
  """rl.train.Trainer with multi-turn episodes in place of single completions."""

  def __init__(
    self, cfg: GRPOConfig, env_factory: EnvFactory | None = None, system: str | None = None
  ):
    super().__init__(cfg)
    cfg, tcfg = self.cfg, self.cfg.train
    if env_factory is None:
      env_factory, system = self._env_factory()
    self.env_factory, self.system = env_factory, system or self.template.system
    head_graphdef, head_params = nnx.split(self._critic(), nnx.Param)
    # On the mesh (replicated where fresh) so that one jit over every process's devices takes it.
    self.head_graphdef, self.head_params = (
      head_graphdef,
      sharding.replicated(self.mesh, head_params),
    )
    learning_rate = setup.learning_rate_schedule(tcfg, tcfg.learning_rate, tcfg.steps)
    self.policy_opt = make_optimizer(
      tcfg.optimizer,
      learning_rate,
      tcfg.weight_decay,
      tcfg.max_grad_norm,
      tcfg.fused_optimizer,
    )
    self.head_opt = optax.adamw(learning_rate, weight_decay=tcfg.weight_decay)
    self.head_opt_state = init_optimizer_state(self.head_opt, self.head_params, self.mesh)
    self._updates: dict[int, Callable] = {}

  def _critic(self) -> ValueHead | CriticModel:
    """The value head on the policy's states, or (train.critic=model) a separate model: a copy of
    the policy's initial weights, or a fresh one of train.critic_preset."""
    tcfg, rngs = self.cfg.train, nnx.Rngs(self.cfg.train.seed)
    if tcfg.critic == "head":
      return ValueHead(self.model.cfg.hidden_size, rngs=rngs)
    if tcfg.critic_preset is None:
      graphdef, params = nnx.split(self.model, nnx.Param)
      trunk = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    else:
      model_cfg = self.cfg.model
      with setup.reading("train.critic_preset", tcfg.critic_preset):
        architecture = preset(
          tcfg.critic_preset, dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype
        )
      if architecture.vocab_size < self.tokenizer.vocab_size:
        raise ConfigError(
          f"train.critic_preset={tcfg.critic_preset}: {architecture.vocab_size} token embeddings, "
          f"the tokenizer has {self.tokenizer.vocab_size}"
        )
      trunk = init_model(architecture, seed=tcfg.seed + 1)
    return CriticModel(trunk, trunk.cfg.hidden_size, rngs=rngs)

  def state(
    self,
  ) -> dict:  # checkpointed: the policy's, and the value head with its optimizer state
    return {**super().state(), "value_head": self.head_params, "value_opt": self.head_opt_state}

  def _restore_state(self, state: dict) -> None:
    super()._restore_state(state)
    self.head_params, self.head_opt_state = state["value_head"], state["value_opt"]

  def _check_prompt_room(self) -> None:
    """No up-front length check: an episode's prompt is an environment observation, and the
    orchestrator ends an episode that would outgrow rollout.max_seq_len (marked truncated)."""

  def _env_factory(self) -> tuple[EnvFactory, str | None]:
    env = self.cfg.env
    if env.name == "grid":
      return (
        lambda: GridEnv(
          env.grid_size, env.grid_holes, env.max_turns, env.grid_min_distance, env.grid_observation
        ),
        GRID_SYSTEM,
      )
    weights = self.cfg.reward.weights()
    return lambda: CalcEnv(self.train_data, env.max_turns, weights), None

  def sft_pair(self, index: int) -> tuple[list[int], list[int]]:
    """The grid's warm-up example: a seeded layout (from seeds that neither training steps nor eval
    draw) played by the expert for a seeded number of turns, in the orchestrator's own multi-turn
    format (first prompt, each expert reply closed with <|im_end|>, each board as the next user
    turn) as the prompt, and the expert's next move as the answer: every turn of an episode, history
    included, looks like one the policy will meet. Other environments: rl.train's worked solutions."""
    if self.cfg.env.name != "grid":
      return super().sft_pair(index)
    env, seed, tok = self.env_factory(), GRID_WARMUP_SEEDS + index, self.tokenizer
    end = tok.encode(IM_END)
    prompt = self.prompt_tokens(env.reset(seed))
    for _ in range(random.Random(seed).randrange(min(env.distance, env.max_turns))):
      move = env.best_move()
      step = env.step(move)  # never the goal: fewer moves than the shortest path
      prompt += tok.encode(move) + end + observation_tokens(tok, step.observation, closed=True)
    return prompt, tok.encode(env.best_move()) + end

  def sft_widths(self, prompts, answers) -> tuple[int, int]:
    """An episode's warm-up prompt is an environment history, not a dataset question: its widths are
    rounded per batch (the same on every process), as the update's are."""
    widths = sharding.allgather(np.array([[max(map(len, prompts)), max(map(len, answers))]])).max(0)
    return tuple(setup.round_up(int(w), WIDTH_BUCKET) for w in widths)

  def prompt_tokens(self, observation: str) -> list[int]:
    messages = [{"role": "system", "content": self.system}] if self.system else []
    return self.tokenizer.encode(chatml(messages + [{"role": "user", "content": observation}]))

  def env_seed(self, step: int, index: int) -> int:
    """The environment seed of prompt `index` of step `step`: calc poses the train set in seeded
    permutation order (as rl.train does), grid draws a layout."""
    if self.cfg.env.name == "calc":
      n = self.cfg.train.prompts_per_step
      epoch, i = divmod(step * n + index, len(self.train_data))
      perm = np.random.default_rng([self.cfg.train.seed, 0, epoch]).permutation(
        len(self.train_data)
      )
      return int(perm[i])
    return self.prompt_seed(step, index)

  def episodes(self, env_seeds: Sequence[int], group: int, seed_of, temperature: float):
    sampling = self.cfg.sampling
    params = SamplingParams(
      max_new_tokens=sampling.max_new_tokens,
      temperature=temperature,
      top_k=sampling.top_k,
      top_p=sampling.top_p,
    )
    seeds = [s for s in env_seeds for _ in range(group)]
    sample_seeds = [seed_of(i) for i in range(len(seeds))]
    envs = [self.env_factory() for _ in seeds]
    return rollout(
      self.engine, self.tokenizer, envs, seeds, sample_seeds, self.prompt_tokens, params
    )

  # ---------------------------------------------------------------------------------------- a step
  def step(self, step: int) -> dict[str, float]:
    cfg, tcfg, timer = self.cfg, self.cfg.train, self.timer
    t_step = time.perf_counter()
    self.compile_watch.take()  # compiles since the last step (evals) are not this step's
    group = cfg.sampling.group_size
    share = process_slice(tcfg.prompts_per_step)  # this process's seeds (all, in one process)
    env_seeds = [self.env_seed(step, i) for i in range(share.start, share.stop)]
    first = share.start * group  # the global index of this process's first episode
    with timer("rollout"):
      episodes, stats = self.episodes(
        env_seeds, group, lambda i: self.prompt_seed(step, first + i), cfg.sampling.temperature
      )
    prompt_len = max(ep.prompt_len for ep in episodes)
    rest_len = max(len(ep.tokens) - ep.prompt_len for ep in episodes)
    # every process packs to the same widths
    widths = sharding.allgather(np.array([[prompt_len, rest_len]])).max(0)
    pw, cw = (setup.round_up(int(w), WIDTH_BUCKET) for w in widths)
    packed = pack_episodes(episodes, pw, cw, self.tokenizer.pad_id)
    k = cfg.grad_accum_steps
    shape = lambda x: sharding.global_batch(self.mesh, x.reshape(k, x.shape[0] // k, *x.shape[1:]))
    # Whitening, explained variance and the value mean are over every process's rows.
    gathered = lambda x: sharding.allgather(np.asarray(x))
    mine = slice(jax.process_index() * len(episodes), (jax.process_index() + 1) * len(episodes))
    with timer("update"):
      tokens, attn, mask = (
        shape(packed.tokens),
        shape(packed.attention_mask),
        shape(packed.model_mask),
      )
      stub = AgentBatch(tokens, attn, mask, *([None] * 4))
      old_logps, old_values = old_logps_and_values(
        self.graphdef, self.head_graphdef, self.params, self.head_params, stub, cw,
        cfg.sampling.temperature,
      )  # fmt: skip
      values = sharding.local_rows(self.mesh, old_values).reshape(-1, cw)  # [N_local, C]
      returns = jnp.zeros_like(old_values)
      if tcfg.algorithm == "ppo":
        adv, ret = ppo.gae(packed.rewards, values, packed.model_mask, tcfg.gamma, tcfg.gae_lambda)
        all_mask = gathered(packed.model_mask)
        if tcfg.whiten_advantages:
          adv = np.asarray(ppo.whiten(gathered(adv), all_mask))[mine]
        returns = shape(np.asarray(ret))
        all_values = gathered(values)
        explained = float(ppo.explained_variance(all_values, gathered(ret), all_mask))
      else:
        totals = np.array([ep.reward for ep in episodes], np.float32)
        per_episode = np.asarray(group_advantages(totals, group))
        adv = np.where(packed.model_mask, per_episode[:, None], 0.0).astype(np.float32)
      ref = None
      if self.ref_params is not None:  # train.beta > 0: the warmed-up policy anchors the update
        ref = batch_token_logps(self.graphdef, self.ref_params, stub, cw, cfg.sampling.temperature)
        ref = jnp.where(mask, ref, 0.0)  # model tokens only, as the old log-probs
      batch = AgentBatch(
        tokens, attn, mask, shape(np.asarray(adv)), old_logps, old_values, returns, ref
      )
      update = self._update(cw)
      state = (self.params, self.head_params, self.opt_state, self.head_opt_state)
      epochs = []
      for _ in range(tcfg.ppo_epochs):
        state, metrics = update(state, batch)
        epochs.append(metrics)
      params, self.head_params, self.opt_state, self.head_opt_state = state
      self._set_params(params)
      epochs = jax.device_get(epochs)
    step_s = time.perf_counter() - t_step
    out = step_time_metrics(timer.reset(), step_s, self.compile_watch, self.step_avg)
    out.update(self._episode_metrics(episodes))
    out["reward/total/mean"] = out["env/reward_mean"]
    counts = sharding.allgather(
      np.array([[stats.generated_tokens, stats.prefill_tokens, stats.engine_calls]])
    )  # [processes, 3]
    out["rollout/generated_tokens"], out["rollout/prefill_tokens"] = counts[:, :2].sum(0).tolist()
    # the processes call their engines at the same time: the most calls, not their sum
    out["rollout/engine_calls"] = int(counts[:, 2].max())
    mean = lambda key: float(np.mean([e[key] for e in epochs]))
    for key in ("loss", "policy_loss", "entropy", "kl", "grad_norm", "nonfinite"):
      out[f"train/{key}"] = mean(key)
    out["ppo/clip_fraction"], out["ppo/approx_kl"] = mean("clip_fraction"), mean("approx_kl")
    if tcfg.algorithm == "ppo":
      out["critic/value_loss"] = mean("value_loss")
      out["critic/value_clip_fraction"] = mean("value_clip_fraction")
      out["critic/explained_variance"] = explained
      out["critic/value_mean"] = float(all_values[all_mask].mean())
    return out

  def _episode_metrics(self, episodes) -> dict[str, float]:
    """rl.rollout.multiturn's episode metrics over every process's episodes (shares may differ by
    one: padded with NaN rows for the gather, dropped after)."""
    rows = episode_rows(episodes)  # [n_local, len(EPISODE_METRICS)]
    if jax.process_count() > 1:
      most = int(sharding.allgather(np.array([len(rows)])).max())
      pad = np.full((most - len(rows), rows.shape[1]), np.nan)
      rows = sharding.allgather(np.concatenate([rows, pad]))
      rows = rows[~np.isnan(rows[:, 0])]
    return dict(zip(EPISODE_METRICS, rows.mean(0).tolist()))

  def _update(self, completion_len: int):
    if completion_len not in self._updates:
      tcfg = self.cfg.train
      settings = UpdateSettings(
        completion_len,
        tcfg.algorithm,
        tcfg.loss_type,
        tcfg.epsilon_low,
        tcfg.epsilon_high,
        self.cfg.sampling.temperature,
        tcfg.vf_coef,
        tcfg.value_clip,
        platform.loss_impl(host_platform(), tcfg.fused_lm_head, tcfg.policy_loss_impl),
        tcfg.fused_lm_head,
        tcfg.beta,
      )
      state = (self.params, self.head_params, self.opt_state, self.head_opt_state)
      self._updates[completion_len] = jax.jit(
        functools.partial(
          update_step, self.graphdef, self.head_graphdef, self.policy_opt, self.head_opt, settings
        ),
        donate_argnums=(0,),
        out_shardings=(shardings_of(state), None),  # the state keeps its layout step after step
      )
    return self._updates[completion_len]

  # ---------------------------------------------------------------------------------------- eval
  def _eval(self, prefix: str, temperature: float, seed: int) -> dict[str, float]:
    t = time.perf_counter()
    n = self.cfg.eval.batch
    if self.cfg.env.name == "calc":  # the test split's problems
      turns, weights = self.cfg.env.max_turns, self.cfg.reward.weights()
      factory = lambda: CalcEnv(self.test_data, turns, weights)
      seeds = list(range(min(n, len(self.test_data))))
    else:  # layouts from seeds no training step draws
      factory, seeds = self.env_factory, [2**31 + i for i in range(n)]
    share = process_slice(len(seeds))  # this process's layouts
    mine = seeds[share]
    envs = [factory() for _ in mine]
    sampling = self.cfg.sampling
    params = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=temperature)
    episodes, _ = rollout(
      self.engine, self.tokenizer, envs, mine, [seed + i for i in range(share.start, share.stop)],
      self.prompt_tokens, params,
    )  # fmt: skip
    m = self._episode_metrics(episodes)
    return {
      f"{prefix}/accuracy": m["env/success_rate"],
      f"{prefix}/reward_mean": m["env/reward_mean"],
      f"{prefix}/turns_mean": m["env/turns_mean"],
      f"{prefix}/examples": len(seeds),
      f"time/{prefix}/step_s": time.perf_counter() - t,
    }

  def eval_sampled(self, step: int) -> dict[str, float]:
    return self._eval("eval", self.cfg.sampling.temperature, self.prompt_seed(step, 10**6))

  def eval_full(self, progress: bool = False) -> dict[str, float]:
    return self._eval("eval_full", 0.0, 0)  # greedy


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
  args = train.arg_parser("python -m rl.agent", __doc__).parse_intermixed_args(argv)
  if args.check:
    return train.run_check(args, "rl.agent")
  cfg = train.config_of(args, "rl.agent")
  train.start_process(cfg)
  trainer = AgentTrainer(cfg)
  try:
    metrics = trainer.run()
  finally:
    trainer.close()
  if "eval_full/accuracy" in metrics:
    print(f"eval_full/success_rate = {metrics['eval_full/accuracy']:.4f}")
  return metrics


def cli(argv: Sequence[str] | None = None) -> int:
  return train.cli(argv, main, "python -m rl.agent")


if __name__ == "__main__":
  sys.exit(cli())
