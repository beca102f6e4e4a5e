"""The run around a step: `--resume`, the SFT warm-up, the steps with their evals, metrics rows and
checkpoints, and the profile window. The same loop drives rl.train's single-turn GRPO step and
rl.agent's multi-turn one: each is a `Program` (its step, its evals, its warm-up examples and what it
adds to a checkpoint) over one `rl.run.setup.Setup` and `rl.run.setup.Policy`.

A checkpoint holds {"params", "opt_state"[, "ref_params"]} (rl.run.setup.Policy) plus the program's own
state (rl.agent: "value_head", "value_opt") and the meta {step, nonfinite_steps, nonfinite_in_a_row}.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Protocol

import jax
import numpy as np
from tqdm import tqdm

from rl.logging.metrics import profiler_options, read_metrics
from rl.optimizer import init_optimizer_state
from rl.run.evaluate import process_slice
from rl.run.setup import Policy, Setup
from rl.update import LossSettings, NonFiniteGuard, compile_train_step, pack


class Program(Protocol):
  """What a run's loop calls: rl.step.GRPOStep (rl.train) or rl.agent.step.AgentStep (rl.agent)."""

  def step(self, step: int) -> dict[str, float]: ...  # one step's metrics row

  def eval_sampled(self, step: int) -> dict[str, float]: ...

  def eval_full(self, progress: bool = False) -> dict[str, float]: ...

  def sft_pair(self, index: int) -> tuple[list[int], list[int]]: ...  # (prompt, answer) tokens

  def sft_widths(self) -> tuple[int, int]: ...  # the SFT batches' (P, C), fixed for the run

  def state(self) -> dict: ...  # what the program adds to a checkpoint ({} for none)

  def restore(self, state: dict) -> None: ...


class Run:
  """One run: `run()` resumes if asked, warms up, steps, evaluates, writes and checkpoints."""

  def __init__(self, setup: Setup, policy: Policy, program: Program, name: str = "rl.train"):
    self.setup, self.policy, self.program, self.name = setup, policy, program, name
    self.cfg = setup.cfg
    self.guard = NonFiniteGuard(self.cfg.train.max_nonfinite_steps)
    self.baseline: dict[str, float] | None = None  # eval_full before the first GRPO step
    self._sft_steps: dict[int, object] = {}  # completion width -> its compiled SFT step

  def step(self, step: int) -> dict[str, float]:
    return self.program.step(step)

  def state(self) -> dict:
    return {**self.policy.state(), **self.program.state()}

  def restore(self, state: dict) -> None:
    self.policy.restore(state)
    self.program.restore(state)

  # ---------------------------------------------------------------------------------------- SFT
  def sft(self, steps: int, progress: bool) -> None:
    """Supervised warm-up on the program's worked examples (prompt + answer + end-of-turn), one
    token-mean NLL step per `sft_sequences` examples; the RL optimizer state is not touched."""
    s, policy = self.setup, self.policy
    opt_state = init_optimizer_state(s.sft_optimizer, policy.params, s.mesh)
    n = self.cfg.sft_sequences
    guard = NonFiniteGuard(self.cfg.train.max_nonfinite_steps, "SFT step")
    bar = tqdm(range(steps), desc="sft", disable=not progress)
    for i in bar:
      pairs = [self.program.sft_pair(i * n + j) for j in range(n)][process_slice(n)]
      prompts, answers = [p for p, _ in pairs], [a for _, a in pairs]
      pw, cw = self.program.sft_widths()
      if cw not in self._sft_steps:
        self._sft_steps[cw] = compile_train_step(
          s.graphdef,
          s.sft_optimizer,
          LossSettings(completion_len=cw, remat=self.cfg.train.remat),
          "sft",
          policy.shardings,
        )
      tokens, mask = pack(prompts, answers, pw, cw, s.tokenizer.pad_id)
      ones = np.ones(len(pairs), np.float32)
      batch = s.to_batch(tokens, mask, ones, accum_steps=self.cfg.sft_accum_steps)
      params, opt_state, metrics = self._sft_steps[cw](policy.params, opt_state, batch)
      policy.set_params(params)
      metrics = jax.device_get(metrics)
      guard.update(bool(metrics["nonfinite"]))
      if s.is_main:
        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
        row = {"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"]}
        s.writer.write(i + 1, row | {"sft/nonfinite_steps": guard.total})
      guard.check(i + 1)

  # ---------------------------------------------------------------------------------------- resume
  def resume(self) -> int:
    """Restores the newest intact checkpoint (skipping unreadable newer ones, with a message) and
    rewinds the metrics to it; the step to continue from (0: none, a fresh start)."""
    s = self.setup
    log = functools.partial(_log, s.is_main, self.name)
    restored = s.checkpointer.restore_latest(self.state(), log=log)
    start = 0
    if restored is None:
      log(f"no checkpoint in {s.checkpointer.directory}: starting from scratch")
    else:
      start, state, meta = restored
      self.restore(state)
      self.guard.total = meta.get("nonfinite_steps", 0)
      self.guard.in_a_row = meta.get("nonfinite_in_a_row", 0)
      log(f"resumed from step {start}")
    dropped = s.writer.rewind(start)
    if dropped:
      log(f"{s.writer.path}: dropped the rows of steps {sorted(set(dropped))} (they run again)")
    if start and s.is_main and os.path.exists(s.writer.path):  # the pre-GRPO eval_full row
      rows = [m for m in read_metrics(self.cfg.run.out_dir) if m.get("step") == 0]
      self.baseline = next((m for m in rows if "eval_full/accuracy" in m), None)
    return start

  def _meta(self, step: int) -> dict:
    return {
      "step": step,
      "nonfinite_steps": self.guard.total,
      "nonfinite_in_a_row": self.guard.in_a_row,
    }

  # ---------------------------------------------------------------------------------------- the run
  def _start(self, progress: bool) -> int:
    """Resume (if asked), or on a fresh start the SFT warm-up and the baseline eval_full; the first
    step to run."""
    cfg = self.cfg
    start = self.resume() if cfg.run.resume else 0
    if start == 0 and cfg.train.warmup_sft_steps:
      self.sft(cfg.train.warmup_sft_steps, progress)
      if self.policy.ref_params is not None:  # the KL term anchors RL to the warmed-up policy
        self.policy.ref_params = self.policy.frozen_copy()
    if start == 0 and (cfg.eval.full_at_end or cfg.eval.full_every):  # what RL starts from
      self.baseline = self.program.eval_full(progress)
      self.setup.writer.write(0, self.baseline)
    return start

  def _after_step(self, done: int, metrics: dict[str, float], progress: bool) -> None:
    """Step `done`'s evals, metrics row, non-finite stop and checkpoint."""
    cfg, s = self.cfg, self.setup
    self.guard.update(metrics["train/nonfinite"] > 0)
    metrics["train/nonfinite_steps"] = self.guard.total
    if cfg.eval.every and done % cfg.eval.every == 0:
      metrics.update(self.program.eval_sampled(done - 1))
    if (cfg.eval.full_every and done % cfg.eval.full_every == 0) or (
      done == cfg.train.steps and cfg.eval.full_at_end
    ):
      metrics.update(self.program.eval_full(progress))
    if done % cfg.run.log_every == 0 or done == cfg.train.steps or self.guard.in_a_row:
      s.writer.write(done, metrics)
    self.guard.check(done)  # the row above says why the run stops
    if s.checkpointer.due(done) or done == cfg.train.steps:
      s.checkpointer.save(done, self.state(), self._meta(done))

  def run(self) -> dict[str, float]:
    """Resume if asked, SFT warm-up (fresh runs), steps with evals and checkpoints; the last step's
    metrics (with eval_full's, when it ran at the end)."""
    cfg = self.cfg
    progress = cfg.run.progress and self.setup.is_main
    start = self._start(progress)
    last: dict[str, float] = {}
    steps = range(start, cfg.train.steps)
    bar = tqdm(
      steps, desc=cfg.train.algorithm, disable=not progress, initial=start, total=cfg.train.steps
    )
    profile = profile_window(cfg, start)
    for step in bar:
      with profile(step):
        metrics = self.program.step(step)
      self._after_step(step + 1, metrics, progress)
      bar.set_postfix(
        reward=f"{metrics['reward/total/mean']:.3f}", step_s=f"{metrics['time/train/step_s']:.2f}"
      )
      last = metrics
    self.setup.writer.flush()
    return last

  def close(self) -> None:
    self.setup.close()


def profile_window(cfg, start: int):
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


def _log(enabled: bool, name: str, msg: str) -> None:
  if enabled:
    print(f"[{name}] {msg}", file=sys.stderr, flush=True)
