"""Step timers and the metric sinks: an append-only `metrics.jsonl`, TensorBoard event files and, with
`run.wandb`, a W&B run (`rl.logging.wandb_sink`).

Only process 0 writes (`enabled=False` elsewhere); every process times its own phases. A resumed run
first `rewind`s every sink to its checkpoint's step, so the steps it runs again are written once.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Mapping

import jax

__all__ = [
  "CompileWatch",
  "MetricsWriter",
  "StepAverage",
  "StepTimer",
  "profiler_options",
  "read_metrics",
  "step_time_metrics",
]

JSONL = "metrics.jsonl"


def profiler_options(python_frames: bool = False) -> jax.profiler.ProfileOptions:
  """Options for every trace this project captures. Python-frame tracing is off by default: it
  records every Python call (millions in a compile-heavy run), hits the trace writer's 1M-event cap and
  crowds out the annotations and device ops a kernel profile is read for."""
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 1 if python_frames else 0
  return opts


class StepTimer:
  """Wall-clock seconds per named phase of the current step (`with timer("rollout"): ...`); each phase
  is also a profiler annotation `grpo/<phase>`, so captured traces show the same breakdown."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, phase: str):
    t0 = time.perf_counter()
    try:
      with jax.profiler.TraceAnnotation(f"grpo/{phase}"):
        yield
    finally:
      self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

  def reset(self) -> dict[str, float]:
    out, self.seconds = self.seconds, {}
    return out


class StepAverage:
  """Mean of the last `window` steady step times (`time/train/step_avg_last10_s`): a step that
  compiled is left out (its time is `time/train/compile_s`'s business), so the figure is the loop's
  steady state from the first compile-free step on. None until one step ran without compiling."""

  def __init__(self, window: int = 10):
    self.times: collections.deque[float] = collections.deque(maxlen=window)

  def add(self, seconds: float, compiled: bool = False) -> float | None:
    if not compiled:
      self.times.append(seconds)
    return sum(self.times) / len(self.times) if self.times else None


# jax.monitoring's duration events of a jit cache miss: trace, lower to MLIR, XLA compile.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
  """Counts XLA compiles (backend compile events) and the seconds spent tracing, lowering and
  compiling while it listens, from jax.monitoring (what jax itself reports, not a guess from the step
  time). `take()` returns (compiles, seconds) since the last take. One per trainer; `close()` stops
  listening. Listens process-wide: work of other threads in the same window counts too."""

  def __init__(self):
    self.compiles, self.seconds = 0, 0.0
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event: str, duration: float, **_) -> None:
    if event == COMPILE_EVENT:
      self.compiles += 1
    if event in (TRACE_EVENT, LOWER_EVENT, COMPILE_EVENT):
      self.seconds += duration

  def take(self) -> tuple[int, float]:
    out = (self.compiles, self.seconds)
    self.compiles, self.seconds = 0, 0.0
    return out

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)


def step_time_metrics(
  times: Mapping[str, float], step_s: float, watch: CompileWatch, average: StepAverage
) -> dict[str, float]:
  """A step's `time/train/*` row: its phases, its wall time, the XLA compiles inside it
  (`compiles`, `compile_s`: seconds jax spent tracing, lowering and compiling) and the steady
  average, which leaves out every step that compiled (absent until a step ran without compiling)."""
  compiles, compile_s = watch.take()
  out = {f"time/train/{k}_s": v for k, v in times.items()}
  out["time/train/step_s"] = step_s
  out["time/train/compiles"] = compiles
  out["time/train/compile_s"] = compile_s
  steady = average.add(step_s, compiled=compiles > 0)
  if steady is not None:
    out["time/train/step_avg_last10_s"] = steady
  return out


def _is_sft_row(row: dict) -> bool:
  return any(k.startswith("sft/") for k in row)


class MetricsWriter:
  """Writes `{step, **metrics}` lines to `<run_dir>/metrics.jsonl`, scalars to TensorBoard and the
  same rows to `wandb` (an `rl.logging.wandb_sink.WandbSink`, or None)."""

  def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = True, wandb=None):
    self.enabled, self.run_dir, self.tensorboard = enabled, run_dir, tensorboard
    self.path = os.path.join(run_dir, JSONL)
    self._tb = None
    self._wandb = wandb if enabled else None
    if not enabled:
      return
    os.makedirs(run_dir, exist_ok=True)
    self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (held for the run; a resumed run continues it)
    self._open_tensorboard(None)

  def _open_tensorboard(self, purge_step: int | None) -> None:
    if not self.tensorboard:
      return
    try:
      from tensorboardX import SummaryWriter
    except ImportError as e:
      raise ImportError(
        "TensorBoard logging needs tensorboardX (pip install tensorboardX), or set "
        "run.tensorboard=false"
      ) from e
    # purge_step: TensorBoard drops the earlier files' events at or after it (the re-run steps).
    self._tb = SummaryWriter(os.path.join(self.run_dir, "tb"), purge_step=purge_step)

  def rewind(self, step: int) -> list[int]:
    """Forget what a run resumed at `step` will write again: jsonl rows of later GRPO steps (SFT rows
    stay, the warm-up is not re-run; at step 0 everything goes), TensorBoard events after `step`, and a
    last line cut off by a kill. Returns the dropped rows' steps."""
    if not self.enabled:
      return []
    self._file.close()
    kept, dropped = [], []
    with open(self.path) as f:
      for line in f:
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut off mid-write
        if step > 0 and (row["step"] <= step or _is_sft_row(row)):
          kept.append(line if line.endswith("\n") else line + "\n")
        else:
          dropped.append(row["step"])
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)  # atomic: a kill now leaves the old file or the new one
    self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (held for the run)
    if self._tb is not None:
      self._tb.close()
      self._open_tensorboard(step + 1)
    if self._wandb is not None:
      self._wandb.rewind(step)
    return dropped

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    clean = {k: float(v) for k, v in metrics.items()}
    self._file.write(json.dumps({"step": step, **clean}) + "\n")
    if self._tb is not None:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, step)
    if self._wandb is not None:
      self._wandb.write(step, clean)

  def flush(self) -> None:
    if self.enabled and self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.close()


def read_metrics(run_dir: str) -> list[dict]:
  """Every line of a run's metrics.jsonl (for tests and the parity report)."""
  with open(os.path.join(run_dir, JSONL)) as f:
    return [json.loads(line) for line in f if line.strip()]
