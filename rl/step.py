"""rl.train's GRPO step, top to bottom (`grpo_step`): rollout (a group of `group_size` completions per
prompt) -> rewards -> group-normalised advantages -> rows packed at the run's fixed widths -> old /
reference log-probs when needed and one micro-batched, gradient-accumulated optimizer update per PPO
epoch (the rollout engine sees the new weights) -> the step's metrics. The helpers it calls, the
single-turn evals and the SFT warm-up's worked solutions sit beside it; `GRPOStep` binds them into the
`rl.run.loop.Program` the run loop drives.

Everything random is a function of (train.seed, step): the prompts of step s, each prompt's sampling
seed, the SFT batches. Restoring the step from a checkpoint therefore restores the data order and RNG.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl import kernel_sharding, mismatch, sharding, support
from rl.advantages import advantage_stats, group_advantages
from rl.data import Example, rewards
from rl.data.tokenizer import IM_END
from rl.logging.metrics import step_time_metrics
from rl.rollout import RolloutResult, SamplingParams
from rl.run.evaluate import evaluate, process_slice
from rl.run.setup import WIDTH_ALIGN, Policy, Setup, example_at, prompt_seed, round_up
from rl.update import Batch, LossSettings, batch_token_logps, compile_train_step, pack


def grpo_step(s: Setup, policy: Policy, train_step, step: int) -> dict[str, float]:
  """One GRPO step: rollout -> reward -> advantage -> pack -> update -> metrics."""
  timer, t_step = s.clock.timer, time.perf_counter()
  s.clock.compiles.take()  # compiles since the last step (evals) are not this step's
  examples = step_examples(s, step)
  share = process_slice(len(examples))  # this process's prompts
  mine = examples[share]
  prompts = [s.encode(e.question) for e in mine]
  with timer("rollout"):
    result = s.engine.generate(prompts, sampling_params(s, step, share.start, len(mine)))
  with timer("reward"):
    scores = score(s, result, mine)
  totals = np.array([sc["total"] for sc in scores], np.float32)
  adv = np.asarray(group_advantages(totals, s.cfg.sampling.group_size))
  tokens, mask, sampler_logps, gaps = pack_rows(s, result)
  with timer("update"):
    batch = s.to_batch(tokens, mask, adv, sampler_logps, support_gaps=gaps)
    losses = optimize(s, policy, train_step, batch)
  step_s = time.perf_counter() - t_step
  return step_metrics(s, result, scores, totals, adv, losses, timer.reset(), step_s)


def step_examples(s: Setup, step: int) -> list[Example]:
  """Every process's prompts of GRPO step `step` (process p takes the p-th contiguous share)."""
  n = s.cfg.train.prompts_per_step
  return [example_at(s.cfg, s.train_data, step * n + i, 0) for i in range(n)]


def sampling_params(s: Setup, step: int, first: int, n: int) -> list[SamplingParams]:
  """The sampling settings of this process's `n` prompts of `step`, the first being global prompt
  `first`: each prompt's group draws from its own seed."""
  sampling = s.cfg.sampling
  return [
    SamplingParams(
      max_new_tokens=sampling.max_new_tokens,
      temperature=sampling.temperature,
      top_k=sampling.top_k,
      top_p=sampling.top_p,
      min_p=sampling.min_p,
      n=sampling.group_size,
      seed=prompt_seed(s.cfg, step, first + i),
    )
    for i in range(n)
  ]


def score(s: Setup, result: RolloutResult, examples: Sequence[Example]) -> list[dict[str, float]]:
  weights = s.cfg.reward.weights()
  return [
    rewards.score(s.tokenizer.decode(c.token_ids), examples[c.prompt_index].gold, weights)
    for c in result.completions
  ]


def pack_rows(s: Setup, result: RolloutResult):
  """The completions as rows at the run's fixed widths: ([N, P + C] tokens, [N, P + C] mask,
  [N, C] the engine's log-probs, [N, C] its support gaps or None, aligned with the rows'
  completions)."""
  c = s.cfg.sampling.max_new_tokens
  tokens, mask = pack(
    [x.prompt_ids for x in result.completions],
    [x.token_ids for x in result.completions],
    s.prompt_width,
    c,
    s.tokenizer.pad_id,
  )
  return tokens, mask, result.padded(c)[2], result.padded_gaps(c)


def optimize(s: Setup, policy: Policy, train_step, batch: Batch) -> list[dict]:
  """Reference / old log-probs when the loss needs them, then one optimizer step per PPO epoch;
  the live weights (and the rollout's) move to the result. Each epoch's metrics."""
  sampling, tcfg = s.cfg.sampling, s.cfg.train
  old = None
  if sampling.filters(s.model.cfg.vocab_size) and batch.sampler_logps is not None:
    batch, old = sampled_support(s, policy, batch)
  logps_of = lambda weights: batch_token_logps(
    s.graphdef, weights, batch, sampling.max_new_tokens, sampling.temperature
  )
  if policy.ref_params is not None:
    batch = batch._replace(ref_logps=logps_of(policy.ref_params))
  if tcfg.ppo_epochs > 1:
    batch = batch._replace(old_logps=logps_of(policy.params) if old is None else old)
  epochs = []
  params, opt_state = policy.params, policy.opt_state
  for _ in range(tcfg.ppo_epochs):
    params, opt_state, epoch_metrics = train_step(params, opt_state, batch)
    epochs.append(epoch_metrics)
  policy.opt_state = opt_state
  policy.set_params(params)
  return jax.device_get(epochs)


def sampled_support(s: Setup, policy: Policy, batch: Batch) -> tuple[Batch, object]:
  """A filtering sampler: the old policy's pass over the batch (rl.support.support_pass) gives the
  raw and truncated log-probs the mismatch metrics compare, and the gaps (the engine's, or replayed
  for one that reports none) that the loss uses under train.score_sampled_support. Returns the
  batch and the old policy's log-probs as the loss scores them (the pass's, for ppo_epochs > 1)."""
  sampling = s.cfg.sampling
  score = s.cfg.train.score_sampled_support
  replay = None if batch.support_gaps is not None else support.replay_of(sampling)
  if replay is not None and score:
    support.say_replayed(s.cfg.rollout.backend)
  truncated, raw, gaps = support.support_pass(
    s.graphdef,
    policy.params,
    batch.tokens,
    batch.attention_mask,
    sampling.max_new_tokens,
    sampling.temperature,
    replay,
    batch.support_gaps,
  )
  batch = batch._replace(raw_logps=raw, truncated_logps=truncated, support_gaps=None)
  if not score:
    return batch, raw
  batch = batch._replace(support_gaps=gaps)
  if replay is not None:  # the engine's full-softmax log-probs onto the replayed support
    mask = batch.attention_mask[..., -sampling.max_new_tokens :]
    sampler = batch.sampler_logps + jnp.where(mask, truncated - raw, 0.0)
    batch = batch._replace(sampler_logps=sampler)
  return batch, truncated


def step_metrics(
  s: Setup,
  result: RolloutResult,
  scores: list[dict[str, float]],  # per local completion
  totals: np.ndarray,  # [N_local] f32 total rewards
  adv: np.ndarray,  # [N_local] f32 advantages
  losses: list[dict],  # per PPO epoch
  times: dict[str, float],  # the step's phase seconds
  step_s: float,
) -> dict[str, float]:
  """The step's row over every process's completions: rewards, advantages, lengths, the update's
  means over the PPO epochs, rollout throughput and the step's times."""
  names = sorted(scores[0])
  local = np.array(
    [
      [sc[n] for n in names] + [len(c.token_ids), c.finish_reason == "length"]
      for sc, c in zip(scores, result.completions)
    ],
    np.float64,
  )
  rows = sharding.allgather(local)  # [all sequences, rewards + length + truncated]
  all_totals, all_adv = sharding.allgather(totals), sharding.allgather(adv)
  generated = rows[:, len(names)].sum()
  out = {"rollout/tokens_per_s": generated / max(times["rollout"], 1e-9)}
  out["rollout/generated_tokens"] = generated
  for j, n in enumerate(names):
    out[f"reward/{n}/mean"], out[f"reward/{n}/std"] = rows[:, j].mean(), rows[:, j].std()
  out.update(advantage_stats(all_totals, all_adv, s.cfg.sampling.group_size))
  out["completion/length_mean"] = rows[:, len(names)].mean()
  out["completion/length_max"] = rows[:, len(names)].max()
  out["completion/truncated_fraction"] = rows[:, len(names) + 1].mean()
  for k in losses[0]:  # means over the PPO epochs (train/nonfinite: the fraction skipped)
    name = k if k.startswith(mismatch.PREFIX) else f"train/{k}"  # mismatch/*: as rl.mismatch names
    out[name] = float(np.mean([epoch[k] for epoch in losses]))
  # last: the compiles of the metrics' own first-step ops count too
  clock = s.clock
  return step_time_metrics(times, step_s, clock.compiles, clock.step_avg) | out


# ---------------------------------------------------------------------------------------- eval
def eval_sampled(s: Setup, step: int) -> dict[str, float]:
  """eval.batch test problems, sampled as in training, one completion each."""
  sampling = s.cfg.sampling
  params = SamplingParams(
    max_new_tokens=sampling.max_new_tokens,
    temperature=sampling.temperature,
    top_k=sampling.top_k,
    top_p=sampling.top_p,
    min_p=sampling.min_p,
    n=1,
    seed=prompt_seed(s.cfg, step, 10**6),
  )
  result = evaluate(s.engine, s.test_data[: s.cfg.eval.batch], s.encode, params)
  means = {"correct": result["accuracy"], "format": result["format"]}  # per reward function
  return {
    "eval/accuracy": result["accuracy"],
    "eval/format": result["format"],
    # the weighted sum, as reward/total/mean in training (rl.data.rewards.score): a mean of sums
    "eval/reward/total/mean": sum(w * means[n] for n, w in s.cfg.reward.weights().items()),
    "time/eval/step_s": result["seconds"],
  }


def eval_full(s: Setup, progress: bool = False) -> dict[str, float]:
  """The whole test split (or data.eval_limit examples), greedy, one completion each: pass@1."""
  params = SamplingParams(max_new_tokens=s.cfg.sampling.max_new_tokens, temperature=0.0, n=1)
  result = evaluate(s.engine, s.test_data, s.encode, params, progress=progress, desc="eval_full")
  return {
    "eval_full/accuracy": result["accuracy"],
    "eval_full/format": result["format"],
    "eval_full/completion_length": result["completion_length"],
    "eval_full/examples": result["examples"],
    "time/eval_full/step_s": result["seconds"],
  }


# ---------------------------------------------------------------------------------------- SFT data
def dataset_sft_pair(s: Setup, index: int) -> tuple[list[int], list[int]]:
  """The `index`-th worked solution of the warm-up: (prompt tokens, answer tokens + end of turn),
  from the train split in seeded order."""
  example = example_at(s.cfg, s.train_data, index, 1)
  answer = s.tokenizer.encode(example.answer) + s.tokenizer.encode(IM_END)
  return s.encode(example.question), answer


def dataset_sft_widths(s: Setup) -> tuple[int, int]:
  """The SFT batch's (prompt, answer) widths: the longest over the train split's worked solutions
  (one compiled SFT step per run; `pack` refuses a row wider than its slot: nothing is cut)."""
  end = len(s.tokenizer.encode(IM_END))
  prompt = max(len(s.encode(e.question)) for e in s.train_data)
  answer = max(len(s.tokenizer.encode(e.answer)) for e in s.train_data) + end
  return round_up(prompt, WIDTH_ALIGN), round_up(answer, WIDTH_ALIGN)


class GRPOStep:
  """rl.train's `rl.run.loop.Program`: the GRPO step over a Setup and a Policy, its evals and the SFT
  warm-up's worked solutions (it adds nothing to a checkpoint)."""

  def __init__(self, setup: Setup, policy: Policy):
    self.setup, self.policy = setup, policy
    cfg = setup.cfg
    self.loss = LossSettings(
      completion_len=cfg.sampling.max_new_tokens,
      spec=cfg.loss_spec,
      impl=setup.loss_impl,
      fused_lm_head=cfg.train.fused_lm_head,
      remat=cfg.train.remat,
      kernel_sharding=kernel_sharding.batch_sharding(setup.mesh),
    )
    self.train_step = compile_train_step(
      setup.graphdef, setup.optimizer, self.loss, "grpo", policy.shardings
    )
    self._sft_widths: tuple[int, int] | None = None

  def step(self, step: int) -> dict[str, float]:
    return grpo_step(self.setup, self.policy, self.train_step, step)

  def eval_sampled(self, step: int) -> dict[str, float]:
    return eval_sampled(self.setup, step)

  def eval_full(self, progress: bool = False) -> dict[str, float]:
    return eval_full(self.setup, progress)

  def sft_pair(self, index: int) -> tuple[list[int], list[int]]:
    return dataset_sft_pair(self.setup, index)

  def sft_widths(self) -> tuple[int, int]:
    if self._sft_widths is None:  # fixed on first use: the warm-up's pairs are the train split's
      self._sft_widths = dataset_sft_widths(self.setup)
    return self._sft_widths

  def state(self) -> dict:
    return {}

  def restore(self, state: dict) -> None:
    pass
