"""rl.agent's step, top to bottom (`agent_step`): `prompts_per_step` environment seeds x `group_size`
episodes, rolled out turn by turn (rl.rollout.multiturn) -> rows packed at the run's fixed widths,
whose loss mask holds only model tokens -> the pre-update pass (old log-probs, the critic's values) and
advantages (grpo: each episode's return normalised within its seed's group; ppo: GAE over model tokens,
optionally whitened) -> one update per PPO epoch (rl.agent.update) -> the step's metrics.

`AgentStep` binds it into the `rl.run.loop.Program` the run loop drives, with the environment, the critic
and its optimizer state (checkpointed as "value_head" / "value_opt"), the multi-turn evals and the
grid's warm-up examples.

The packed widths are fixed before step 1 (`episode_widths`), so the update and the pre-update pass
compile once per run: the prompt width from the longest first prompt over every environment seed the
run draws, the completion width from the room rollout.max_seq_len leaves after the shortest one (an
episode never outgrows max_seq_len: the orchestrator ends it, marked truncated).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl import sharding, support
from rl.advantages import group_advantages
from rl.agent import ppo
from rl.agent.critic import CriticModel, ValueHead
from rl.agent.update import (
  AgentBatch,
  compile_update,
  head_optimizer,
  old_logps_and_values,
  pre_update_mismatch,
  update_settings,
)
from rl.configlib import ConfigError
from rl.data.tokenizer import IM_END, chatml
from rl.env import CalcEnv, Environment, GridEnv
from rl.logging.metrics import step_time_metrics
from rl.model import init_model, preset
from rl.optimizer import init_optimizer_state
from rl.rollout import SamplingParams
from rl.rollout.multiturn import (
  EPISODE_METRICS,
  episode_rows,
  observation_tokens,
  pack_episodes,
  rollout,
)
from rl.run.evaluate import process_slice
from rl.run.setup import (
  WIDTH_ALIGN,
  Policy,
  Setup,
  permuted_index,
  prompt_seed,
  reading,
  round_up,
)
from rl.step import dataset_sft_pair, dataset_sft_widths
from rl.update import batch_token_logps

GRID_SYSTEM = "Walk @ to G on the ice, avoiding holes H. Reply with one move."
# Grid warm-up layouts come from seeds above the steps' (< 2**31) and eval's (2**31 + i).
GRID_WARMUP_SEEDS = 2**32

EnvFactory = Callable[[], Environment]


def agent_step(a: AgentStep, step: int) -> dict[str, float]:
  """One multi-turn step: episodes -> pack -> old log-probs, values, advantages -> update -> metrics."""
  s, cfg = a.setup, a.setup.cfg
  timer, t_step = s.clock.timer, time.perf_counter()
  s.clock.compiles.take()  # compiles since the last step (evals) are not this step's
  group = cfg.sampling.group_size
  share = process_slice(cfg.train.prompts_per_step)  # this process's seeds (all, in one process)
  env_seeds = [a.env_seed(step, i) for i in range(share.start, share.stop)]
  first = share.start * group  # the global index of this process's first episode
  with timer("rollout"):
    episodes, stats = a.episodes(
      env_seeds, group, lambda i: prompt_seed(cfg, step, first + i), cfg.sampling.temperature
    )
  packed = pack_episodes(episodes, *a.widths, s.tokenizer.pad_id)
  with timer("update"):
    batch, figures = advantages_batch(a, packed, episodes)
    epochs = a.update(batch)
  step_s = time.perf_counter() - t_step
  out = step_time_metrics(timer.reset(), step_s, s.clock.compiles, s.clock.step_avg)
  return out | step_metrics(a, episodes, stats, epochs, figures)


def advantages_batch(a: AgentStep, packed, episodes) -> tuple[AgentBatch, dict[str, float]]:
  """The update's global batch: the packed rows, the pre-update policy's log-probs and the critic's
  values, the advantages and value targets, the reference's log-probs (train.beta > 0); and the
  pass's figures: mismatch/* (the engine's log-probs against the old pass) and, for ppo, the
  critic's explained variance and value mean over every process's model tokens."""
  s, tcfg, temp = a.setup, a.setup.cfg.train, a.setup.cfg.sampling.temperature
  k, cw = s.cfg.grad_accum_steps, a.widths[1]
  shape = lambda x: sharding.global_batch(s.mesh, x.reshape(k, x.shape[0] // k, *x.shape[1:]))
  # Whitening, explained variance and the value mean are over every process's rows.
  gathered = lambda x: sharding.allgather(np.asarray(x))
  mine = slice(jax.process_index() * len(episodes), (jax.process_index() + 1) * len(episodes))
  tokens, attn, mask = (
    shape(packed.tokens),
    shape(packed.attention_mask),
    shape(packed.model_mask),
  )
  reported = None if packed.support_gaps is None else shape(packed.support_gaps)
  v, params = s.model.cfg.vocab_size, a.policy.params
  gaps = support.batch_gaps(s.cfg, v, s.graphdef, params, reported, tokens, attn, cw, mask)
  stub = AgentBatch(tokens, attn, mask, *([None] * 4), support_gaps=gaps)
  old_logps, old_values, raw = old_logps_and_values(
    s.graphdef, a.head_graphdef, a.policy.params, a.head_params, stub, cw, temp
  )
  eps = (tcfg.epsilon_low, tcfg.epsilon_high)  # mismatch/*: the engine's against the old pass
  found = pre_update_mismatch(shape(packed.sampler_logps), old_logps, raw, mask, eps)
  values = sharding.local_rows(s.mesh, old_values).reshape(-1, cw)  # [N_local, C]
  returns, figures = jnp.zeros_like(old_values), {k: float(v) for k, v in found.items()}
  if tcfg.algorithm == "ppo":
    adv, ret = ppo.gae(packed.rewards, values, packed.model_mask, tcfg.gamma, tcfg.gae_lambda)
    all_mask = gathered(packed.model_mask)
    if tcfg.whiten_advantages:
      adv = np.asarray(ppo.whiten(gathered(adv), all_mask))[mine]
    returns = shape(np.asarray(ret))
    all_values = gathered(values)
    figures["critic/explained_variance"] = float(
      ppo.explained_variance(all_values, gathered(ret), all_mask)
    )
    figures["critic/value_mean"] = float(all_values[all_mask].mean())
  else:
    totals = np.array([ep.reward for ep in episodes], np.float32)
    per_episode = np.asarray(group_advantages(totals, s.cfg.sampling.group_size))
    adv = np.where(packed.model_mask, per_episode[:, None], 0.0).astype(np.float32)
  ref = None
  if a.policy.ref_params is not None:  # train.beta > 0: the warmed-up policy anchors the update
    ref = batch_token_logps(s.graphdef, a.policy.ref_params, stub, cw, temp)
    ref = jnp.where(mask, ref, 0.0)  # model tokens only, as the old log-probs
  batch = AgentBatch(
    tokens, attn, mask, shape(np.asarray(adv)), old_logps, old_values, returns, ref, gaps
  )
  return batch, figures


def step_metrics(a: AgentStep, episodes, stats, epochs, figures) -> dict[str, float]:
  """The episodes' metrics over every process, the rollout's counts, the update's means over the
  PPO epochs (critic/* for ppo) and the pre-update pass's `figures` (advantages_batch)."""
  out = episode_metrics(episodes)
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
  if a.setup.cfg.train.algorithm == "ppo":
    out["critic/value_loss"] = mean("value_loss")
    out["critic/value_clip_fraction"] = mean("value_clip_fraction")
  return out | figures


def episode_metrics(episodes) -> dict[str, float]:
  """rl.rollout.multiturn's episode metrics over every process's episodes (shares may differ by
  one: padded with NaN rows for the gather, dropped after)."""
  rows = episode_rows(episodes)  # [n_local, len(EPISODE_METRICS)]
  if jax.process_count() > 1:
    most = int(sharding.allgather(np.array([len(rows)])).max())
    pad = np.full((most - len(rows), rows.shape[1]), np.nan)
    rows = sharding.allgather(np.concatenate([rows, pad]))
    rows = rows[~np.isnan(rows[:, 0])]
  return dict(zip(EPISODE_METRICS, rows.mean(0).tolist()))


def episode_widths(a: AgentStep) -> tuple[int, int]:
  """The packed (prompt, completion) widths of every step, fixed before step 1: the longest first
  prompt over every environment seed the run's steps draw, and the room
  rollout.max_seq_len leaves after the shortest, each rounded up to WIDTH_ALIGN. A first prompt with
  no room under max_seq_len is a ConfigError now, not a failure in some later step's rollout."""
  cfg = a.setup.cfg
  n = cfg.train.prompts_per_step
  seeds = sorted({a.env_seed(t, i) for t in range(cfg.train.steps) for i in range(n)})
  env = a.env_factory()
  lengths = [len(a.prompt_tokens(env.reset(seed))) for seed in seeds]
  limit = cfg.rollout.max_seq_len
  if max(lengths) >= limit:
    raise ConfigError(
      f"rollout.max_seq_len={limit} is too short for env.name={cfg.env.name}: its longest first "
      f"prompt is {max(lengths)} tokens; set rollout.max_seq_len >= "
      f"{max(lengths) + cfg.sampling.max_new_tokens}"
    )
  return round_up(max(lengths), WIDTH_ALIGN), round_up(limit - min(lengths), WIDTH_ALIGN)


class AgentStep:
  """rl.agent's `rl.run.loop.Program`: multi-turn episodes of an environment, the policy's update with a
  critic (a value head on the policy's states, or a separate model), the multi-turn evals."""

  def __init__(
    self,
    setup: Setup,
    policy: Policy,
    env_factory: EnvFactory | None = None,
    system: str | None = None,
  ):
    self.setup, self.policy = setup, policy
    if env_factory is None:
      env_factory, system = self._env_factory()
    self.env_factory, self.system = env_factory, system or setup.template.system
    head_graphdef, head_params = nnx.split(self._critic(), nnx.Param)
    # On the mesh (replicated where fresh) so that one jit over every process's devices takes it.
    self.head_graphdef = head_graphdef
    self.head_params = sharding.replicated(setup.mesh, head_params)
    # the policy's optimizer is the run's (rl.run.setup.optimizer_for): on several devices its fused
    # kernels update each device's own shard, as the opt_state it built is laid out
    self.policy_opt = setup.optimizer
    self.head_opt = head_optimizer(setup.cfg)
    self.head_opt_state = init_optimizer_state(self.head_opt, self.head_params, setup.mesh)
    self._updates: dict[int, Callable] = {}
    self.widths = episode_widths(self)  # (P, C) of every step's rows
    self._sft_widths: tuple[int, int] | None = None  # the warm-up's, on first use

  def _critic(self) -> ValueHead | CriticModel:
    """The value head on the policy's states, or (train.critic=model) a separate model: a copy of
    the policy's initial weights, or a fresh one of train.critic_preset."""
    s = self.setup
    tcfg, rngs = s.cfg.train, nnx.Rngs(s.cfg.train.seed)
    if tcfg.critic == "head":
      return ValueHead(s.model.cfg.hidden_size, rngs=rngs)
    if tcfg.critic_preset is None:
      graphdef, params = nnx.split(s.model, nnx.Param)
      trunk = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    else:
      model_cfg = s.cfg.model
      with reading("train.critic_preset", tcfg.critic_preset):
        architecture = preset(
          tcfg.critic_preset, dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype
        )
      if architecture.vocab_size < s.tokenizer.vocab_size:
        raise ConfigError(
          f"train.critic_preset={tcfg.critic_preset}: {architecture.vocab_size} token embeddings, "
          f"the tokenizer has {s.tokenizer.vocab_size}"
        )
      trunk = init_model(architecture, seed=tcfg.seed + 1)
    return CriticModel(trunk, trunk.cfg.hidden_size, rngs=rngs)

  def _env_factory(self) -> tuple[EnvFactory, str | None]:
    env, s = self.setup.cfg.env, self.setup
    if env.name == "grid":
      return (
        lambda: GridEnv(
          env.grid_size, env.grid_holes, env.max_turns, env.grid_min_distance, env.grid_observation
        ),
        GRID_SYSTEM,
      )
    weights = s.cfg.reward.weights()
    return lambda: CalcEnv(s.train_data, env.max_turns, weights), None

  # ---------------------------------------------------------------------------------------- episodes
  def prompt_tokens(self, observation: str) -> list[int]:
    messages = [{"role": "system", "content": self.system}] if self.system else []
    return self.setup.tokenizer.encode(
      chatml(messages + [{"role": "user", "content": observation}])
    )

  def env_seed(self, step: int, index: int) -> int:
    """The environment seed of prompt `index` of step `step`: calc poses the train set in seeded
    permutation order (as rl.train does), grid draws a layout."""
    cfg = self.setup.cfg
    if cfg.env.name == "calc":
      n = cfg.train.prompts_per_step
      return permuted_index(cfg, len(self.setup.train_data), step * n + index, 0)
    return prompt_seed(cfg, step, index)

  def episodes(self, env_seeds: Sequence[int], group: int, seed_of, temperature: float):
    s, sampling = self.setup, self.setup.cfg.sampling
    params = SamplingParams(
      max_new_tokens=sampling.max_new_tokens,
      temperature=temperature,
      top_k=sampling.top_k,
      top_p=sampling.top_p,
      min_p=sampling.min_p,
    )
    seeds = [seed for seed in env_seeds for _ in range(group)]
    sample_seeds = [seed_of(i) for i in range(len(seeds))]
    envs = [self.env_factory() for _ in seeds]
    return rollout(s.engine, s.tokenizer, envs, seeds, sample_seeds, self.prompt_tokens, params)

  # ---------------------------------------------------------------------------------------- update
  def update_for(self, completion_len: int):
    """The update compiled at completion width `completion_len` (one per run: the widths are
    fixed up front)."""
    if completion_len not in self._updates:
      s = self.setup
      settings = update_settings(s.cfg, s.loss_impl, completion_len, s.mesh)
      self._updates[completion_len] = compile_update(
        s.graphdef, self.head_graphdef, self.policy_opt, self.head_opt, settings, self._state()
      )
    return self._updates[completion_len]

  def _state(self):
    p = self.policy
    return (p.params, self.head_params, p.opt_state, self.head_opt_state)

  def update(self, batch: AgentBatch) -> list[dict]:
    """One update per PPO epoch; the policy (and the rollout's weights) and the critic move."""
    update, state, epochs = self.update_for(batch.model_mask.shape[-1]), self._state(), []
    for _ in range(self.setup.cfg.train.ppo_epochs):
      state, metrics = update(state, batch)
      epochs.append(metrics)
    params, self.head_params, self.policy.opt_state, self.head_opt_state = state
    self.policy.set_params(params)
    return jax.device_get(epochs)

  def step(self, step: int) -> dict[str, float]:
    return agent_step(self, step)

  # ---------------------------------------------------------------------------------------- eval
  def _eval(self, prefix: str, temperature: float, seed: int) -> dict[str, float]:
    t, s = time.perf_counter(), self.setup
    n = s.cfg.eval.batch
    if s.cfg.env.name == "calc":  # the test split's problems
      turns, weights = s.cfg.env.max_turns, s.cfg.reward.weights()
      factory = lambda: CalcEnv(s.test_data, turns, weights)
      seeds = list(range(min(n, len(s.test_data))))
    else:  # layouts from seeds no training step draws
      factory, seeds = self.env_factory, [2**31 + i for i in range(n)]
    share = process_slice(len(seeds))  # this process's layouts
    mine = seeds[share]
    envs = [factory() for _ in mine]
    params = SamplingParams(max_new_tokens=s.cfg.sampling.max_new_tokens, temperature=temperature)
    episodes, _ = rollout(
      s.engine, s.tokenizer, envs, mine, [seed + i for i in range(share.start, share.stop)],
      self.prompt_tokens, params,
    )  # fmt: skip
    m = episode_metrics(episodes)
    return {
      f"{prefix}/accuracy": m["env/success_rate"],
      f"{prefix}/reward_mean": m["env/reward_mean"],
      f"{prefix}/turns_mean": m["env/turns_mean"],
      f"{prefix}/examples": len(seeds),
      f"time/{prefix}/step_s": time.perf_counter() - t,
    }

  def eval_sampled(self, step: int) -> dict[str, float]:
    cfg = self.setup.cfg
    return self._eval("eval", cfg.sampling.temperature, prompt_seed(cfg, step, 10**6))

  def eval_full(self, progress: bool = False) -> dict[str, float]:
    return self._eval("eval_full", 0.0, 0)  # greedy

  # ---------------------------------------------------------------------------------------- SFT
  def sft_pair(self, index: int) -> tuple[list[int], list[int]]:
    """The grid's warm-up example: a seeded layout (from seeds that neither training steps nor eval
    draw) played by the expert for a seeded number of turns, in the orchestrator's own multi-turn
    format (first prompt, each expert reply closed with <|im_end|>, each board as the next user
    turn) as the prompt, and the expert's next move as the answer: every turn of an episode, history
    included, looks like one the policy will meet. Other environments: rl.train's worked solutions."""
    if self.setup.cfg.env.name != "grid":
      return dataset_sft_pair(self.setup, index)
    env, seed, tok = self.env_factory(), GRID_WARMUP_SEEDS + index, self.setup.tokenizer
    end = tok.encode(IM_END)
    prompt = self.prompt_tokens(env.reset(seed))
    for _ in range(random.Random(seed).randrange(min(env.distance, env.max_turns))):
      move = env.best_move()
      step = env.step(move)  # never the goal: fewer moves than the shortest path
      prompt += tok.encode(move) + end + observation_tokens(tok, step.observation, closed=True)
    return prompt, tok.encode(env.best_move()) + end

  def sft_widths(self) -> tuple[int, int]:
    """The warm-up batch's (prompt, answer) widths, fixed on first use so that the SFT step compiles
    once: the grid's, the longest over every expert example the warm-up draws (a function of the
    index alone, the same on every process); other environments', rl.train's (the train split's
    longest worked solution)."""
    if self._sft_widths is None:
      cfg = self.setup.cfg
      if cfg.env.name == "grid":
        pairs = [self.sft_pair(i) for i in range(cfg.train.warmup_sft_steps * cfg.sft_sequences)]
        longest = (max(len(p) for p, _ in pairs), max(len(a) for _, a in pairs))
        self._sft_widths = tuple(round_up(w, WIDTH_ALIGN) for w in longest)
      else:
        self._sft_widths = dataset_sft_widths(self.setup)
    return self._sft_widths

  # ---------------------------------------------------------------------------------------- checkpoint
  def state(self) -> dict:  # checkpointed beside the policy's: the critic and its optimizer state
    return {"value_head": self.head_params, "value_opt": self.head_opt_state}

  def restore(self, state: dict) -> None:
    self.head_params, self.head_opt_state = state["value_head"], state["value_opt"]
