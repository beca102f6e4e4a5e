"""The sections of the run's configuration tree other than `train` (rl.config.train) and the tree
itself (rl.config.GRPOConfig): model, data, reward, sampling, env, eval, mesh, run, dist. Each is a
frozen dataclass whose `__post_init__` range-checks its fields (rl.configlib.check_range), naming the
key, the allowed range and the value.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kernels.tpu_targets import Slice
from rl.configlib import check_range
from rl.data.prompts import TEMPLATES
from rl.data.synthetic import LEVELS
from rl.env.grid import OBSERVATIONS as GRID_OBSERVATIONS
from rl.logging.wandb_config import WandbConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  preset: str = "tiny"  # rl.model presets; ignored when `checkpoint` is set
  checkpoint: str | None = None  # a local HF directory (config.json + *.safetensors)
  tokenizer: str | None = (
    None  # a directory with tokenizer.json; None: the checkpoint's, else embedded
  )
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"

  def __post_init__(self):
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class DataSection:
  dataset: Literal["synthetic", "gsm8k"] = "synthetic"
  # gsm8k: a directory with train.jsonl / test.jsonl (None: rl.data.gsm8k.DEFAULT_DIRS, the first found)
  path: str | None = None
  template: str = "compact"  # rl.data.prompts.TEMPLATES
  train_limit: int | None = None  # keep the first N train examples (None: all)
  eval_limit: int | None = None  # eval_full on the first N test examples (None: the whole split)
  synthetic_levels: tuple[int, ...] = (1, 2)  # rl.data.synthetic difficulty levels
  synthetic_train: int = 5000  # synthetic examples per split (drawn with different seeds)
  synthetic_test: int = 200

  def __post_init__(self):
    for name in ("train_limit", "eval_limit"):
      check_range(f"data.{name}", getattr(self, name), ge=1, optional=True)
    for name in ("synthetic_train", "synthetic_test"):
      check_range(f"data.{name}", getattr(self, name), ge=1)
    if not self.synthetic_levels or not set(self.synthetic_levels) <= set(LEVELS):
      raise ValueError(
        f"data.synthetic_levels must be a non-empty list of levels from {list(LEVELS)}, got "
        f"{list(self.synthetic_levels)}"
      )
    if self.template not in TEMPLATES:
      raise ValueError(f"data.template must be one of {sorted(TEMPLATES)}, got {self.template!r}")


@dataclasses.dataclass(frozen=True)
class RewardSection:
  """Weights of the reward functions (rl.data.rewards.REWARD_FNS); the total is the weighted sum."""

  correct: float = 1.0
  format: float = 0.1

  def __post_init__(self):
    for field in dataclasses.fields(self):  # a negative weight would train towards wrong answers
      check_range(f"reward.{field.name}", getattr(self, field.name), ge=0)

  def weights(self) -> dict[str, float]:
    return {k: v for k, v in dataclasses.asdict(self).items() if v != 0.0}


@dataclasses.dataclass(frozen=True)
class SamplingSection:
  group_size: int = 8  # completions per prompt (the GRPO group)
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 64

  def __post_init__(self):
    if self.group_size < 2:
      raise ValueError(
        "sampling.group_size must be >= 2 (advantages compare samples of a prompt), got "
        f"{self.group_size}"
      )
    check_range("sampling.temperature", self.temperature, gt=0)  # training rollouts sample
    check_range("sampling.top_k", self.top_k, ge=0)  # 0: off
    check_range("sampling.top_p", self.top_p, gt=0, le=1)  # 1: off
    check_range("sampling.max_new_tokens", self.max_new_tokens, ge=1)


@dataclasses.dataclass(frozen=True)
class EnvSection:
  """The environment of a multi-turn run (python -m rl.agent; rl/env). calc: the tool-use arithmetic
  environment on the `data` problems; grid: the seeded frozen lake. Each reply has at most
  sampling.max_new_tokens tokens; an episode at most rollout.max_seq_len tokens."""

  name: Literal["calc", "grid"] = "calc"
  max_turns: int = 3
  grid_size: int = 4
  grid_holes: int = 3
  grid_min_distance: int = 2
  # words: the goal's offset and the moves to avoid; safe: the goal's offset and the safe moves
  grid_observation: Literal["board", "words", "safe"] = "board"

  def __post_init__(self):
    if self.name not in ("calc", "grid"):
      raise ValueError(f"env.name must be calc or grid, got {self.name!r}")
    check_range("env.max_turns", self.max_turns, ge=1)
    check_range("env.grid_size", self.grid_size, ge=2, le=16)
    check_range("env.grid_holes", self.grid_holes, ge=0, le=self.grid_size**2 - 3)
    check_range("env.grid_min_distance", self.grid_min_distance, ge=1, le=2 * (self.grid_size - 1))
    if self.grid_observation not in GRID_OBSERVATIONS:
      raise ValueError(
        f"env.grid_observation must be one of {', '.join(GRID_OBSERVATIONS)}, "
        f"got {self.grid_observation!r}"
      )


@dataclasses.dataclass(frozen=True)
class EvalSection:
  every: int = 0  # steps between sampled evals (0: off)
  batch: int = 32  # prompts in a sampled eval
  full_every: int = 0  # steps between eval_full runs (0: only at the end, if full_at_end)
  full_at_end: bool = True

  def __post_init__(self):
    for name in ("every", "full_every"):
      check_range(f"eval.{name}", getattr(self, name), ge=0)  # 0: off
    check_range("eval.batch", self.batch, ge=1)


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """Mesh axis sizes; one may be -1 (the devices left). Without -1 the first dp*fsdp*tp devices.
  `topology`: the TPU slice the config is written for, as users rent it ("v6e-8", "v4-16"; parsed by
  kernels.tpu_targets.Slice.parse): --check compiles the run's programs for its devices."""

  dp: int = 1
  fsdp: int = -1
  tp: int = 1
  topology: str | None = None

  def __post_init__(self):
    sizes = (self.dp, self.fsdp, self.tp)
    if any(v == 0 or v < -1 for v in sizes) or sizes.count(-1) > 1:
      raise ValueError(
        f"mesh.dp, mesh.fsdp and mesh.tp must be positive, with at most one -1; got dp={self.dp} "
        f"fsdp={self.fsdp} tp={self.tp}"
      )
    if self.topology is not None:
      try:
        Slice.parse(self.topology)
      except ValueError as e:
        raise ValueError(f"mesh.topology={self.topology!r}: {e}") from e

  @property
  def slice(self) -> Slice | None:
    """The TPU slice of `topology` (None: not set)."""
    return None if self.topology is None else Slice.parse(self.topology)

  def resolve(self, num_devices: int) -> MeshSection:
    known = abs(self.dp * self.fsdp * self.tp)
    if -1 not in (self.dp, self.fsdp, self.tp):
      if known > num_devices:
        raise ValueError(
          f"mesh dp*fsdp*tp = {known} needs more than the {num_devices} devices available"
        )
      return self
    if num_devices % known:
      raise ValueError(f"{num_devices} devices do not divide by the fixed mesh axes ({known})")
    fill = num_devices // known
    dp, fsdp, tp = (fill if v == -1 else v for v in (self.dp, self.fsdp, self.tp))
    return dataclasses.replace(self, dp=dp, fsdp=fsdp, tp=tp)


@dataclasses.dataclass(frozen=True)
class RunSection:
  out_dir: str = "runs/default"
  checkpoint_every: int = 0  # 0: only at the end
  resume: bool = (
    False  # continue from the newest checkpoint in out_dir (a fresh start if there is none)
  )
  log_every: int = 1
  tensorboard: bool = True
  progress: bool = True  # a progress bar on the console (process 0)
  host_devices: int | None = None  # simulate this many CPU devices (set before jax starts)
  profile_steps: int = (
    0  # capture a profiler trace of this many GRPO steps (after the compiling first)
  )
  profile_dir: str | None = None  # default: profiles/<basename of out_dir>
  wandb: WandbConfig = WandbConfig()  # noqa: RUF009 (frozen) W&B as a metric sink (rl.logging.wandb_sink)

  def __post_init__(self):
    check_range("run.checkpoint_every", self.checkpoint_every, ge=0)
    check_range("run.profile_steps", self.profile_steps, ge=0)
    check_range("run.log_every", self.log_every, ge=1)
    check_range("run.host_devices", self.host_devices, ge=1, optional=True)


@dataclasses.dataclass(frozen=True)
class DistributedSection:
  """Multi-process runs: `initialize=true` calls jax.distributed.initialize (null fields: detected from
  the cluster environment, as on TPU pods and SLURM). Every process runs the same command."""

  initialize: bool = False
  coordinator_address: str | None = None  # "host:port" of process 0
  num_processes: int | None = None
  process_id: int | None = None
  cpu_collectives: Literal["gloo", "mpi", "megascale"] = (
    "gloo"  # CPU cross-process collectives (tests run 2 local processes on CPU)
  )

  def __post_init__(self):
    check_range("dist.num_processes", self.num_processes, ge=1, optional=True)
    if self.process_id is not None:
      limit = self.num_processes if self.num_processes is not None else 2**31
      check_range("dist.process_id", self.process_id, ge=0, lt=limit)
