"""Weights & Biases as a metric sink (`run.wandb`, `rl.logging.wandb_config.WandbConfig`): the rows
metrics.jsonl gets, the run's config, and at the end a summary holding the verdict keys.

Process 0 only (rl.logging.metrics.MetricsWriter owns it, as it owns the jsonl and TensorBoard sinks). Rows go
in order, W&B counting them (`_step`); each carries its own x-axis: `step` (GRPO steps, the jsonl's
step; the step-0 row is eval_full before GRPO) or `sft/step` (the warm-up's rows), declared with
`define_metric` so W&B plots every key against the right one.

Resume: W&B keeps what it was sent, so instead of dropping rows as the jsonl does, the sink remembers
its run id and the last GRPO step it logged (`<run.out_dir>/wandb-run.json`); a resumed run reopens the
same W&B run (`resume="allow"`) and logs only the steps after that one, so every step appears once
(the loop is deterministic: a step run again gives the same numbers, its times aside). Offline, the
resumed part is a second `wandb/offline-run-*` directory with the same id; `wandb sync` joins them. A
fresh start (no checkpoint) opens a new W&B run.

Key names: ours, plus the seed runs' name where theirs differs (`ALIASES`, ours -> theirs), so their
verdict keys (`VERDICT_KEYS`, read from the run summary) are all there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from rl.configlib import ConfigError
from rl.logging.wandb_config import WandbConfig

# What the seed runs read from a W&B run's summary to compare runs (bench.parity --wandb-summaries).
VERDICT_KEYS = (
  "eval_full/accuracy",
  "eval/reward/func/reward_correct/mean",
  "eval/reward/total/mean",
  "time/train/step_avg_last10_s",
  "time/eval_full/step_s",
)
# Our metric name -> the seed runs' name for the same figure, where they differ. eval/accuracy is the
# sampled eval's mean correctness reward (rl.step.eval_sampled: correctness is 0 or 1 per completion).
ALIASES = {"eval/accuracy": "eval/reward/func/reward_correct/mean"}
STATE = "wandb-run.json"  # {"id": W&B run id, "last_step": last GRPO step logged}


def import_wandb(mode: str):
  """The wandb module, or a ConfigError naming the key that asked for it and the extra to install."""
  try:
    import wandb
  except ImportError as e:
    raise ConfigError(
      f"run.wandb.mode={mode} needs the wandb package, which is not installed: pip install "
      '"grpo-kernels[wandb]" (or set run.wandb.mode=disabled)'
    ) from e
  return wandb


def with_aliases(metrics: Mapping[str, float]) -> dict[str, float]:
  """`metrics` plus each aliased key under the seed runs' name too."""
  return {**metrics, **{ALIASES[k]: v for k, v in metrics.items() if k in ALIASES}}


class WandbSink:
  """`write(step, metrics)` / `rewind(step)` / `close()`, as rl.logging.metrics.MetricsWriter calls them. The
  W&B run opens at the first write (after a resume's rewind, so it knows which run to continue)."""

  def __init__(self, cfg: WandbConfig, run_dir: str, config: Mapping[str, Any]):
    self.cfg, self.run_dir, self.config = cfg, run_dir, dict(config)
    self.state_path = os.path.join(run_dir, STATE)
    # a missing package fails at set-up, not after the first step
    self._wandb = import_wandb(cfg.mode)
    self._run = None
    self._resume_id: str | None = None
    self._logged_through = 0  # GRPO steps <= this are already in the resumed W&B run
    self._axes: set[str] = set()
    # the last value of each key in a GRPO step's row (step >= 1); the step-0 row's keys
    self._final: dict[str, float] = {}
    self._before: set[str] = set()

  def rewind(self, step: int) -> None:
    """A run resumed at `step` (0: no checkpoint, a fresh start): continue the W&B run the state file
    names, skipping the steps it already has."""
    if self._run is not None:
      raise RuntimeError("WandbSink.rewind must come before the first write")
    state = self._read_state()
    if step > 0 and state is not None:
      self._resume_id, self._logged_through = state["id"], state["last_step"]

  def _read_state(self) -> dict | None:
    if not os.path.exists(self.state_path):
      return None
    with open(self.state_path) as f:
      return json.load(f)

  def _write_state(self, last_step: int) -> None:
    tmp = self.state_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"id": self._run.id, "last_step": last_step}, f)
    os.replace(tmp, self.state_path)  # atomic: a kill leaves the old state or the new one

  def _open(self):
    if self._run is None:
      name = self.cfg.name or os.path.basename(os.path.normpath(self.run_dir))
      self._run = self._wandb.init(
        project=self.cfg.project,
        name=name,
        mode=self.cfg.mode,
        dir=self.run_dir,
        config=self.config,
        id=self._resume_id,
        resume="allow" if self._resume_id else None,
        # our rows carry the console's figures; W&B's console capture would wrap sys.stdout
        settings=self._wandb.Settings(console="off"),
      )
      self._run.define_metric("step")
      self._run.define_metric("sft/step")
    return self._run

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    sft = any(k.startswith("sft/") for k in metrics)
    if not sft and self._resume_id is not None and step <= self._logged_through:
      return  # the resumed W&B run has this step already
    run = self._open()
    axis = "sft/step" if sft else "step"
    row = {**with_aliases(metrics), axis: step}
    for key in row.keys() - self._axes - {"step", "sft/step"}:
      run.define_metric(key, step_metric=axis)
      self._axes.add(key)
    run.log(row)
    if sft:
      return
    if step == 0:
      self._before |= row.keys()
    else:
      self._final |= row
    self._write_state(step)

  def close(self) -> None:
    """Finish the run, its summary's verdict keys from the last GRPO step that had them. W&B's
    summary holds each key's last value, so without this a run with no eval_full after GRPO
    (eval.full_at_end=false) would report the step-0 row's accuracy before GRPO as its result: such
    a key is removed from the summary instead."""
    if self._run is None:
      return
    for key in VERDICT_KEYS:
      if key in self._final:
        self._run.summary[key] = self._final[key]
      elif key in self._before:
        del self._run.summary[key]
    self._run.finish()
    # finish() can return before W&B's service has written the rows to the run's local log (offline,
    # wandb 0.31: 5 of 8 logs read right after finish() held only their 7-byte header); teardown waits
    # for the service, so the run's files are complete when close() returns.
    self._wandb.teardown()
    self._run = None


def open_sink(cfg: WandbConfig, run_dir: str, config: Mapping[str, Any]) -> WandbSink | None:
  """The sink `cfg` asks for, or None when run.wandb.mode is disabled."""
  return None if cfg.mode == "disabled" else WandbSink(cfg, run_dir, config)
