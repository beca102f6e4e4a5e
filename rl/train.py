"""The GRPO run: `python -m rl.train --config configs/cpu-default.yaml [key.sub=value ...] [--resume]`.

A step reads top to bottom: rollout (a group of `group_size` completions per prompt) -> rewards ->
group-normalised advantages -> old / reference log-probs when needed -> one micro-batched,
gradient-accumulated optimizer update per PPO epoch -> the rollout engine sees the new weights.

Everything random is a function of (train.seed, step): the prompts of step s, each prompt's sampling
seed, the SFT batches. Restoring the step from a checkpoint therefore restores the data order and RNG.

A bad config value stops the run before anything compiles: the command prints the message (it names
the key and the allowed values) and exits with status 2. An update with a non-finite loss or gradient
norm is skipped (`train/nonfinite_steps` counts them); `train.max_nonfinite_steps` in a row stop the run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from kernels.backend import host_platform
from rl import configlib, mismatch, platform, rewards, sharding
from rl.advantages import advantage_stats, group_advantages
from rl.checkpointing import Checkpointer
from rl.cli import (
  arg_parser,
  config_of,
  parse_args,
  run_check,
  run_cli,
  start_process,
  target_platform,
)
from rl.config import GRPOConfig
from rl.configlib import ConfigError
from rl.data import Example
from rl.evaluate import before_after_table, evaluate
from rl.evaluate import process_slice as _share
from rl.metrics import (
  CompileWatch,
  MetricsWriter,
  StepAverage,
  StepTimer,
  profiler_options,
  read_metrics,
  step_time_metrics,
)
from rl.prompts import TEMPLATES
from rl.rollout import RolloutResult, SamplingParams, make_engine
from rl.setup import (
  WIDTH_ALIGN,
  build_model,
  check_prompt_room,
  load_data,
  optimizer_for,
  resolve_mesh,
  round_up,
  tokenizer_of,
)
from rl.tokenizer import IM_END
from rl.update import (
  Batch,
  LossSettings,
  NonFiniteGuard,
  batch_token_logps,
  compile_train_step,
  init_optimizer_state,
  pack,
  shardings_of,
)

# The command line's and the set-up's names, as rl.train always offered them (rl.agent, bench, tests).
__all__ = ["WIDTH_ALIGN", "Trainer", "arg_parser", "cli", "config_of", "load_data", "main"]
__all__ += ["parse_args", "round_up", "run_check", "start_process", "target_platform"]


class Trainer:
  """Owns the model, rollout engine, optimizer state, data order, metrics and checkpoints of one run."""

  def __init__(self, cfg: GRPOConfig):
    cfg, self.mesh = resolve_mesh(cfg)
    self.cfg = cfg
    train_cfg = cfg.train
    # the loss impl this host's platform has: a ConfigError now, not a minute into compiling
    impl = platform.loss_impl(host_platform(), train_cfg.fused_lm_head, train_cfg.policy_loss_impl)
    self.is_main = jax.process_index() == 0
    self.tokenizer = tokenizer_of(cfg)
    tokenizer_key = "model.tokenizer" if cfg.model.tokenizer else "model.checkpoint"
    self.template = TEMPLATES[cfg.data.template]  # the config checked the name
    self.train_data, self.test_data = load_data(cfg)
    self._encoded: dict[str, list[int]] = {}
    self._check_prompt_room()

    self.model = build_model(cfg, self.mesh)
    if self.tokenizer.vocab_size > self.model.cfg.vocab_size:
      raise ConfigError(
        f"{tokenizer_key}: the tokenizer has {self.tokenizer.vocab_size} tokens, the model only "
        f"{self.model.cfg.vocab_size}"
      )
    self.graphdef, self.params = nnx.split(self.model, nnx.Param)
    # Several processes: each rolls out its own prompts on a local replica of the weights.
    self.rollout_model = (
      self.model if jax.process_count() == 1 else nnx.merge(self.graphdef, self._local_params())
    )
    self.engine = make_engine(self.rollout_model, cfg.rollout, self.tokenizer)
    optimizer_with = functools.partial(optimizer_for, cfg, self.mesh, self.params)

    optimizer = optimizer_with(train_cfg.learning_rate, train_cfg.steps)
    self.opt_state = init_optimizer_state(optimizer, self.params, self.mesh)
    self.loss = LossSettings(
      completion_len=cfg.sampling.max_new_tokens,
      spec=cfg.loss_spec,
      impl=impl,
      fused_lm_head=train_cfg.fused_lm_head,
      mesh=self.mesh if cfg.mesh.tp > 1 else None,
      vocab_axis="tp" if cfg.mesh.tp > 1 else None,
    )
    self.state_shardings = (shardings_of(self.params), shardings_of(self.opt_state))
    self.train_step = compile_train_step(
      self.graphdef, optimizer, self.loss, "grpo", self.state_shardings
    )
    sft_rate = train_cfg.sft_learning_rate or train_cfg.learning_rate
    self._sft = (optimizer_with(sft_rate, train_cfg.warmup_sft_steps), {})
    # The reference policy: a frozen copy of the weights GRPO starts from (taken again after the SFT
    # warm-up, checkpointed with the run), kept only when the KL term is on.
    self.ref_params = jax.tree.map(jnp.copy, self.params) if train_cfg.beta > 0 else None
    self.guard = NonFiniteGuard(train_cfg.max_nonfinite_steps)
    self.baseline: dict[str, float] | None = None  # eval_full before the first GRPO step

    self.timer, self.step_avg, self.compile_watch = StepTimer(), StepAverage(10), CompileWatch()
    self.writer = MetricsWriter(
      cfg.run.out_dir, enabled=self.is_main, tensorboard=cfg.run.tensorboard
    )
    self.checkpointer = Checkpointer(
      os.path.join(cfg.run.out_dir, "checkpoints"), cfg.run.checkpoint_every
    )
    if self.is_main:
      configlib.dump(cfg, os.path.join(cfg.run.out_dir, "config.yaml"))

  # ---------------------------------------------------------------------------------------- data
  def _check_prompt_room(self) -> None:
    """A ConfigError now, before anything compiles, if a prompt leaves no room (`check_prompt_room`);
    sets the update's one prompt width."""
    self.prompt_width = check_prompt_room(self.cfg, self.encode, self.train_data, self.test_data)

  def encode(self, question: str) -> list[int]:
    if question not in self._encoded:
      self._encoded[question] = self.template.encode(question, self.tokenizer)
    return self._encoded[question]

  def _order(self, pos: int, stream: int) -> Example:
    """The example at position `pos` of the infinite sequence of seeded train-set permutations."""
    epoch, i = divmod(pos, len(self.train_data))
    perm = np.random.default_rng([self.cfg.train.seed, stream, epoch]).permutation(
      len(self.train_data)
    )
    return self.train_data[perm[i]]

  def step_examples(self, step: int) -> list[Example]:
    """Every process's prompts of GRPO step `step` (process p takes the p-th contiguous share)."""
    n = self.cfg.train.prompts_per_step
    return [self._order(step * n + i, 0) for i in range(n)]

  def prompt_seed(self, step: int, index: int) -> int:
    return (self.cfg.train.seed * 1_000_003 + step * 65_537 + index) % (2**31)

  def _local_params(self):
    """The full weights on this process's first device (the multi-process rollout replica)."""
    return jax.device_put(sharding.allgather(self.params), jax.local_devices()[0])

  def _set_params(self, params) -> None:
    self.params = params
    nnx.update(self.model, params)
    if self.rollout_model is not self.model:
      nnx.update(self.rollout_model, self._local_params())

  def _to_batch(
    self,
    tokens: np.ndarray,  # [N_local, T]
    mask: np.ndarray,  # [N_local, T]
    advantages: np.ndarray,  # [N_local]
    sampler_logps: np.ndarray | None = None,  # [N_local, C] the engine's, 0 on padding
    accum_steps: int | None = None,  # K; None: the GRPO step's grad_accum_steps
  ) -> Batch:
    """This process's rows -> the global [K, M, ...] batch."""
    k = accum_steps or self.cfg.grad_accum_steps
    shape = lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:])
    put = lambda x: sharding.global_batch(self.mesh, shape(x))
    sampler = None if sampler_logps is None else put(sampler_logps.astype(np.float32))
    return Batch(put(tokens), put(mask), put(advantages.astype(np.float32)), sampler_logps=sampler)

  # ---------------------------------------------------------------------------------------- GRPO step
  def step(self, step: int) -> dict[str, float]:
    """One GRPO step, top to bottom: rollout -> reward -> advantage -> pack -> update."""
    timer, t_step = self.timer, time.perf_counter()
    self.compile_watch.take()  # compiles since the last step (evals) are not this step's
    examples = self.step_examples(step)
    share = _share(len(examples))  # this process's prompts
    mine = examples[share]
    prompts = [self.encode(e.question) for e in mine]
    with timer("rollout"):
      result = self.engine.generate(prompts, self.sampling_params(step, share.start, len(mine)))
    with timer("reward"):
      scores = self._score(result, mine)
    totals = np.array([sc["total"] for sc in scores], np.float32)
    adv = np.asarray(group_advantages(totals, self.cfg.sampling.group_size))
    rows = self._pack(result)
    with timer("update"):
      losses = self._optimize(self._to_batch(*rows[:2], adv, rows[2]))
    step_s = time.perf_counter() - t_step
    return self._step_metrics(result, scores, totals, adv, losses, timer.reset(), step_s)

  def sampling_params(self, step: int, first: int, n: int) -> list[SamplingParams]:
    """The sampling settings of this process's `n` prompts of `step`, the first being global prompt
    `first`: each prompt's group draws from its own seed."""
    sampling = self.cfg.sampling
    return [
      SamplingParams(
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        n=sampling.group_size,
        seed=self.prompt_seed(step, first + i),
      )
      for i in range(n)
    ]

  def _pack(self, result: RolloutResult):
    """The completions as rows at the run's fixed widths: ([N, P + C] tokens, [N, P + C] mask,
    [N, C] the engine's log-probs, aligned with the rows' completions)."""
    c = self.cfg.sampling.max_new_tokens
    tokens, mask = pack(
      [x.prompt_ids for x in result.completions],
      [x.token_ids for x in result.completions],
      self.prompt_width,
      c,
      self.tokenizer.pad_id,
    )
    return tokens, mask, result.padded(c)[2]

  def _optimize(self, batch: Batch) -> list[dict]:
    """Reference / old log-probs when the loss needs them, then one optimizer step per PPO epoch;
    the live weights (and the rollout's) move to the result. Each epoch's metrics."""
    sampling, tcfg = self.cfg.sampling, self.cfg.train
    logps_of = lambda weights: batch_token_logps(
      self.graphdef, weights, batch, sampling.max_new_tokens, sampling.temperature
    )
    if self.ref_params is not None:
      batch = batch._replace(ref_logps=logps_of(self.ref_params))
    if tcfg.ppo_epochs > 1:
      batch = batch._replace(old_logps=logps_of(self.params))
    epochs = []
    params, opt_state = self.params, self.opt_state
    for _ in range(tcfg.ppo_epochs):
      params, opt_state, epoch_metrics = self.train_step(params, opt_state, batch)
      epochs.append(epoch_metrics)
    self.opt_state = opt_state
    self._set_params(params)
    return jax.device_get(epochs)

  def _score(self, result: RolloutResult, examples: Sequence[Example]) -> list[dict[str, float]]:
    weights = self.cfg.reward.weights()
    return [
      rewards.score(self.tokenizer.decode(c.token_ids), examples[c.prompt_index].gold, weights)
      for c in result.completions
    ]

  def _step_metrics(self, result, scores, totals, adv, losses, times, step_s) -> dict[str, float]:
    group_size = self.cfg.sampling.group_size
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
    out.update(advantage_stats(all_totals, all_adv, group_size))
    out["completion/length_mean"] = rows[:, len(names)].mean()
    out["completion/length_max"] = rows[:, len(names)].max()
    out["completion/truncated_fraction"] = rows[:, len(names) + 1].mean()
    for k in losses[0]:  # means over the PPO epochs (train/nonfinite: the fraction skipped)
      name = (
        k if k.startswith(mismatch.PREFIX) else f"train/{k}"
      )  # mismatch/*: as rl.mismatch names
      out[name] = float(np.mean([epoch[k] for epoch in losses]))
    # last: the compiles of the metrics' own first-step ops count too
    return step_time_metrics(times, step_s, self.compile_watch, self.step_avg) | out

  # ---------------------------------------------------------------------------------------- SFT warm-up
  def sft_pair(self, index: int) -> tuple[list[int], list[int]]:
    """The `index`-th worked solution of the warm-up: (prompt tokens, answer tokens + end of turn),
    from the train split in seeded order."""
    example = self._order(index, 1)
    answer = self.tokenizer.encode(example.answer) + self.tokenizer.encode(IM_END)
    return self.encode(example.question), answer

  def sft_widths(self, prompts, answers) -> tuple[int, int]:
    """The SFT batch's (prompt, answer) widths: the longest over the train split's worked solutions,
    fixed on first use (one compiled SFT step per run). rl.agent's episodes override it."""
    if not hasattr(self, "_sft_width"):  # the warm-up's pairs (sft_pair) are the train split's
      end = len(self.tokenizer.encode(IM_END))
      prompt = max(len(self.encode(e.question)) for e in self.train_data)
      answer = max(len(self.tokenizer.encode(e.answer)) for e in self.train_data) + end
      self._sft_width = (round_up(prompt, WIDTH_ALIGN), round_up(answer, WIDTH_ALIGN))
    return self._sft_width  # (`pack` refuses a row wider than its slot: nothing is cut)

  def sft(self, steps: int, progress: bool) -> None:
    """Supervised warm-up on worked solutions (prompt + answer + end-of-turn), one token-mean NLL step
    per `sft_sequences` examples; the GRPO optimizer state starts fresh afterwards."""
    optimizer, compiled = self._sft
    opt_state = init_optimizer_state(optimizer, self.params, self.mesh)
    n = self.cfg.sft_sequences
    guard = NonFiniteGuard(self.cfg.train.max_nonfinite_steps, "SFT step")
    bar = tqdm(range(steps), desc="sft", disable=not progress)
    for i in bar:
      pairs = [self.sft_pair(i * n + j) for j in range(n)][_share(n)]
      prompts, answers = [p for p, _ in pairs], [a for _, a in pairs]
      pw, cw = self.sft_widths(prompts, answers)
      if cw not in compiled:
        compiled[cw] = compile_train_step(
          self.graphdef, optimizer, LossSettings(completion_len=cw), "sft", self.state_shardings
        )
      tokens, mask = pack(prompts, answers, pw, cw, self.tokenizer.pad_id)
      batch = self._to_batch(
        tokens, mask, np.ones(len(pairs), np.float32), accum_steps=self.cfg.sft_accum_steps
      )
      params, opt_state, step_metrics = compiled[cw](self.params, opt_state, batch)
      self._set_params(params)
      step_metrics = jax.device_get(step_metrics)
      guard.update(bool(step_metrics["nonfinite"]))
      if self.is_main:
        bar.set_postfix(loss=f"{float(step_metrics['loss']):.3f}")
        self.writer.write(
          i + 1,
          {
            "sft/loss": step_metrics["loss"],
            "sft/grad_norm": step_metrics["grad_norm"],
            "sft/nonfinite_steps": guard.total,
          },
        )
      guard.check(i + 1)

  # ---------------------------------------------------------------------------------------- eval
  def eval_sampled(self, step: int) -> dict[str, float]:
    sampling = self.cfg.sampling
    params = SamplingParams(
      max_new_tokens=sampling.max_new_tokens,
      temperature=sampling.temperature,
      top_k=sampling.top_k,
      top_p=sampling.top_p,
      n=1,
      seed=self.prompt_seed(step, 10**6),
    )
    result = evaluate(self.engine, self.test_data[: self.cfg.eval.batch], self.encode, params)
    return {
      "eval/accuracy": result["accuracy"],
      "eval/format": result["format"],
      "time/eval/step_s": result["seconds"],
    }

  def eval_full(self, progress: bool = False) -> dict[str, float]:
    """The whole test split (or data.eval_limit examples), greedy, one completion each: pass@1."""
    params = SamplingParams(max_new_tokens=self.cfg.sampling.max_new_tokens, temperature=0.0, n=1)
    result = evaluate(
      self.engine, self.test_data, self.encode, params, progress=progress, desc="eval_full"
    )
    return {
      "eval_full/accuracy": result["accuracy"],
      "eval_full/format": result["format"],
      "eval_full/completion_length": result["completion_length"],
      "eval_full/examples": result["examples"],
      "time/eval_full/step_s": result["seconds"],
    }

  # ---------------------------------------------------------------------------------------- the run
  def state(self) -> dict:
    state = {"params": self.params, "opt_state": self.opt_state}
    if self.ref_params is not None:
      state["ref_params"] = self.ref_params
    return state

  def _restore_state(self, state: dict) -> None:
    """Takes back what `state()` saved (a subclass with more state extends both)."""
    self.opt_state = state["opt_state"]
    self._set_params(state["params"])
    self.ref_params = state.get("ref_params", self.ref_params)

  def _meta(self, step: int) -> dict:
    return {
      "step": step,
      "nonfinite_steps": self.guard.total,
      "nonfinite_in_a_row": self.guard.in_a_row,
    }

  def _resume(self) -> int:
    """Restores the newest intact checkpoint (skipping unreadable newer ones, with a message) and
    rewinds the metrics to it; the step to continue from (0: none, a fresh start)."""
    log = functools.partial(_log, self.is_main)
    restored = self.checkpointer.restore_latest(self.state(), log=log)
    start = 0
    if restored is None:
      log(f"no checkpoint in {self.checkpointer.directory}: starting from scratch")
    else:
      start, state, meta = restored
      self._restore_state(state)
      self.guard.total = meta.get("nonfinite_steps", 0)
      self.guard.in_a_row = meta.get("nonfinite_in_a_row", 0)
      log(f"resumed from step {start}")
    dropped = self.writer.rewind(start)
    if dropped:
      log(f"{self.writer.path}: dropped the rows of steps {sorted(set(dropped))} (they run again)")
    if start and self.is_main and os.path.exists(self.writer.path):  # the pre-GRPO eval_full row
      rows = [m for m in read_metrics(self.cfg.run.out_dir) if m.get("step") == 0]
      self.baseline = next((m for m in rows if "eval_full/accuracy" in m), None)
    return start

  def run(self) -> dict[str, float]:
    """Resume if asked, SFT warm-up (fresh runs), GRPO steps with evals and checkpoints; the last
    step's metrics (with eval_full's, when it ran at the end)."""
    cfg, progress = self.cfg, self.cfg.run.progress and self.is_main
    start = self._resume() if cfg.run.resume else 0
    if start == 0 and cfg.train.warmup_sft_steps:
      self.sft(cfg.train.warmup_sft_steps, progress)
      if self.ref_params is not None:  # the KL term anchors GRPO to the warmed-up policy
        self.ref_params = jax.tree.map(jnp.copy, self.params)
    if start == 0 and (cfg.eval.full_at_end or cfg.eval.full_every):  # what GRPO starts from
      self.baseline = self.eval_full(progress)
      self.writer.write(0, self.baseline)
    last: dict[str, float] = {}
    bar = tqdm(
      range(start, cfg.train.steps),
      desc=cfg.train.algorithm,
      disable=not progress,
      initial=start,
      total=cfg.train.steps,
    )
    profile = _profile_window(cfg, start)
    for step in bar:
      with profile(step):
        metrics = self.step(step)
      done = step + 1
      self.guard.update(metrics["train/nonfinite"] > 0)
      metrics["train/nonfinite_steps"] = self.guard.total
      if cfg.eval.every and done % cfg.eval.every == 0:
        metrics.update(self.eval_sampled(step))
      if (cfg.eval.full_every and done % cfg.eval.full_every == 0) or (
        done == cfg.train.steps and cfg.eval.full_at_end
      ):
        metrics.update(self.eval_full(progress))
      if done % cfg.run.log_every == 0 or done == cfg.train.steps or self.guard.in_a_row:
        self.writer.write(done, metrics)
      self.guard.check(done)  # the row above says why the run stops
      if self.checkpointer.due(done) or done == cfg.train.steps:
        self.checkpointer.save(done, self.state(), self._meta(done))
      bar.set_postfix(
        reward=f"{metrics['reward/total/mean']:.3f}", step_s=f"{metrics['time/train/step_s']:.2f}"
      )
      last = metrics
    self.writer.flush()
    return last

  def close(self) -> None:
    self.compile_watch.close()
    self.writer.close()
    self.checkpointer.close()
    self.engine.close()


def _profile_window(cfg: GRPOConfig, start: int):
  """`with window(step):` traces steps start+1 .. start+profile_steps into run.profile_dir (the first
  step compiles, so it is left out), viewable in TensorBoard and readable by `python -m bench.trace`."""
  n = cfg.run.profile_steps
  first, last = start + 1, start + n
  path = cfg.run.profile_dir or os.path.join(
    "profiles", os.path.basename(os.path.normpath(cfg.run.out_dir))
  )

  @contextlib.contextmanager
  def window(step: int):
    if n and step == first:
      jax.profiler.start_trace(
        path, create_perfetto_trace=True, profiler_options=profiler_options()
      )
    try:
      yield
    finally:
      if n and step == min(last, cfg.train.steps - 1):
        jax.profiler.stop_trace()

  return window


def _log(enabled: bool, msg: str) -> None:
  if enabled:
    print(f"[rl.train] {msg}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
  """The run (config errors raise ConfigError); `cli` is the command line's wrapper."""
  args = arg_parser(doc=__doc__).parse_intermixed_args(argv)
  if args.check:
    return run_check(args, "rl.train")
  cfg = config_of(args, "rl.train")  # every config value error surfaces here, before jax starts
  start_process(cfg)
  trainer = Trainer(cfg)
  try:
    metrics = trainer.run()
  finally:
    trainer.close()
  if trainer.is_main and "eval_full/accuracy" in metrics:
    if trainer.baseline is not None:
      print(before_after_table(trainer.baseline, metrics))
    print(
      f"eval_full/accuracy = {metrics['eval_full/accuracy']:.4f} "
      f"({int(metrics['eval_full/examples'])} examples)"
    )
  return metrics


def cli(argv: Sequence[str] | None = None, main=main, prog: str = "python -m rl.train") -> int:
  """`main` for the command line: a config error is its message alone on stderr and exit status 2
  (argparse's status for bad usage), not a traceback around it; a run stopped by non-finite steps or
  with no readable checkpoint to resume is its message and status 1. `rl.agent` passes its own main."""
  return run_cli(argv, main, prog)


if __name__ == "__main__":
  sys.exit(cli())
