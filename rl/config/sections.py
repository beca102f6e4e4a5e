"""The sections of the run's configuration tree other than `train` (rl.config.train) and the tree
itself (rl.config.GRPOConfig): model, data, reward, sampling, env, eval, mesh, run, dist. Each is a
frozen dataclass whose `__post_init__` range-checks its fields from its `RANGES` table
(rl.configlib.check_ranges), naming the key, the allowed range and the value; `CHOICES` and `RULES`
hold the other fields' allowed values. The configuration reference in docs/ prints these tables.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from kernels.tpu_targets import Slice
from rl.configlib import Bound, Range, check_ranges
from rl.data.prompts import TEMPLATES
from rl.data.synthetic import LEVELS
from rl.env.grid import OBSERVATIONS as GRID_OBSERVATIONS
from rl.logging.wandb_config import WandbConfig

__all__ = [
  "DTYPES",
  "DataSection",
  "DistributedSection",
  "EnvSection",
  "EvalSection",
  "MeshSection",
  "ModelSection",
  "RewardSection",
  "RunSection",
  "SamplingSection",
]

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """The policy model: a preset (random weights, the embedded tokenizer) or a local checkpoint."""

  preset: str = "tiny"  # rl.model presets; ignored when `checkpoint` is set
  checkpoint: str | None = None  # a local HF directory (config.json + *.safetensors)
  tokenizer: str | None = (
    None  # a directory with tokenizer.json; None: the checkpoint's, else embedded
  )
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"  # the stored parameters' dtype
  # rl.model.numerics: rollouts and the trainer give a token the same bits (the XLA attention in
  # decode: rollout.attn_impl "xla", or "auto" on CPU; not the sglang_jax backend)
  batch_invariant: bool = False

  CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"dtype": DTYPES, "param_dtype": DTYPES}

  def __post_init__(self):
    for name, allowed in self.CHOICES.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"model.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")

  @property
  def overrides(self) -> dict:
    """The rl.model.ModelConfig fields this section sets over a preset's or a checkpoint's."""
    return dict(
      dtype=self.dtype, param_dtype=self.param_dtype, batch_invariant=self.batch_invariant
    )


@dataclasses.dataclass(frozen=True)
class DataSection:
  """The prompts: synthetic arithmetic problems (embedded, no download) or GSM8K files."""

  dataset: Literal["synthetic", "gsm8k"] = "synthetic"  # the problem source
  # gsm8k: a directory with train.jsonl / test.jsonl (None: rl.data.gsm8k.DEFAULT_DIRS, the first found)
  path: str | None = None
  template: str = "compact"  # rl.data.prompts.TEMPLATES
  train_limit: int | None = None  # keep the first N train examples (None: all)
  eval_limit: int | None = None  # eval_full on the first N test examples (None: the whole split)
  synthetic_levels: tuple[int, ...] = (1, 2)  # rl.data.synthetic difficulty levels
  synthetic_train: int = 5000  # synthetic examples per split (drawn with different seeds)
  synthetic_test: int = 200  # synthetic test examples (eval_full's split)

  RANGES: ClassVar[dict[str, Range]] = {
    "train_limit": Range(ge=1, optional=True),
    "eval_limit": Range(ge=1, optional=True),
    "synthetic_train": Range(ge=1),
    "synthetic_test": Range(ge=1),
  }

  CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"template": tuple(sorted(TEMPLATES))}
  RULES: ClassVar[dict[str, str]] = {
    "synthetic_levels": f"a non-empty list of levels from {list(LEVELS)}"
  }

  def __post_init__(self):
    check_ranges(self, "data")
    if not self.synthetic_levels or not set(self.synthetic_levels) <= set(LEVELS):
      raise ValueError(
        f"data.synthetic_levels must be {self.RULES['synthetic_levels']}, got "
        f"{list(self.synthetic_levels)}"
      )
    if self.template not in self.CHOICES["template"]:
      raise ValueError(
        f"data.template must be one of {list(self.CHOICES['template'])}, got {self.template!r}"
      )


@dataclasses.dataclass(frozen=True)
class RewardSection:
  """Weights of the reward functions (rl.data.rewards.REWARD_FNS); the total is the weighted sum."""

  correct: float = 1.0  # the final answer equals the reference answer (rl.rewards)
  format: float = 0.1  # the completion follows the prompt template's answer format

  # a negative weight would train towards wrong answers
  RANGES: ClassVar[dict[str, Range]] = {"correct": Range(ge=0), "format": Range(ge=0)}

  def __post_init__(self):
    check_ranges(self, "reward")

  def weights(self) -> dict[str, float]:
    return {k: v for k, v in dataclasses.asdict(self).items() if v != 0.0}


@dataclasses.dataclass(frozen=True)
class SamplingSection:
  """How the rollout samples: the GRPO group size, temperature, top-k / top-p / min-p, completion
  length. The filters keep a threshold set (ties with the last kept token kept), their intersection;
  the trainer scores each token over the set it was drawn from (train.score_sampled_support)."""

  group_size: int = 8  # completions per prompt (the GRPO group)
  temperature: float = 1.0  # training rollouts sample; the trainer's logits are scaled by it too
  top_k: int = 0  # sample among the k most likely tokens (and those tied with the k-th); 0: off
  top_p: float = 1.0  # nucleus sampling; 1: off
  min_p: float = 0.0  # keep tokens of probability >= min_p x the most likely one's; 0: off
  max_new_tokens: int = 64  # completion length limit (and dr_grpo's divisor)

  RANGES: ClassVar[dict[str, Range]] = {
    "group_size": Range(ge=2),  # advantages compare samples of a prompt
    "temperature": Range(gt=0),
    "top_k": Range(ge=0),
    "top_p": Range(gt=0, le=1),
    "min_p": Range(ge=0, le=1),
    "max_new_tokens": Range(ge=1),
  }

  def __post_init__(self):
    check_ranges(self, "sampling")

  def filters(self, vocab_size: int) -> bool:
    """Whether the rollout draws from a truncated distribution (top-k below the vocabulary, top-p
    below 1, or min-p above 0): its tokens then carry support gaps."""
    return 0 < self.top_k < vocab_size or self.top_p < 1.0 or self.min_p > 0.0


@dataclasses.dataclass(frozen=True)
class EnvSection:
  """The environment of a multi-turn run (python -m rl.agent; rl/env). calc: the tool-use arithmetic
  environment on the `data` problems; grid: the seeded frozen lake. Each reply has at most
  sampling.max_new_tokens tokens; an episode at most rollout.max_seq_len tokens."""

  name: Literal["calc", "grid"] = "calc"  # the environment
  max_turns: int = 3  # model replies per episode
  grid_size: int = 4  # grid: the board's side
  grid_holes: int = 3  # grid: holes on the board (an episode ends in one)
  grid_min_distance: int = 2  # grid: the least Manhattan distance from start to goal
  # board: the board as text; words: the goal's offset and the moves to avoid; safe: the goal's
  # offset and the safe moves
  grid_observation: Literal["board", "words", "safe"] = "board"

  RANGES: ClassVar[dict[str, Range]] = {
    "max_turns": Range(ge=1),
    "grid_size": Range(ge=2, le=16),
    "grid_holes": Range(ge=0, le=Bound("grid_size**2 - 3", lambda s: s.grid_size**2 - 3)),
    "grid_min_distance": Range(
      ge=1, le=Bound("2 * (grid_size - 1)", lambda s: 2 * (s.grid_size - 1))
    ),
  }

  def __post_init__(self):
    if self.name not in ("calc", "grid"):
      raise ValueError(f"env.name must be calc or grid, got {self.name!r}")
    check_ranges(self, "env")
    if self.grid_observation not in GRID_OBSERVATIONS:
      raise ValueError(
        f"env.grid_observation must be one of {', '.join(GRID_OBSERVATIONS)}, "
        f"got {self.grid_observation!r}"
      )


@dataclasses.dataclass(frozen=True)
class EvalSection:
  """Evaluations during and after the run: sampled evals on a batch, eval_full on the test split."""

  every: int = 0  # steps between sampled evals (0: off)
  batch: int = 32  # prompts in a sampled eval
  full_every: int = 0  # steps between eval_full runs (0: only at the end, if full_at_end)
  full_at_end: bool = True  # eval_full (greedy, the whole test split) after the last step

  RANGES: ClassVar[dict[str, Range]] = {
    "every": Range(ge=0),
    "batch": Range(ge=1),
    "full_every": Range(ge=0),
  }

  def __post_init__(self):
    check_ranges(self, "eval")


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """Mesh axis sizes; one may be -1 (the devices left). Without -1 the first dp*fsdp*tp devices.
  `topology`: the TPU slice the config is written for, as users rent it ("v6e-8", "v4-16"; parsed by
  kernels.tpu_targets.Slice.parse): --check compiles the run's programs for its devices."""

  dp: int = 1  # data parallel: replicas, each a slice of the batch
  fsdp: int = -1  # fully sharded data parallel: the batch and the parameters split
  tp: int = 1  # tensor parallel: heads and vocabulary split
  topology: str | None = None  # the TPU slice the config is written for ("v6e-8"); null: none

  AXIS = "positive, with at most one -1"  # the rule of dp / fsdp / tp, as checked below
  RULES: ClassVar[dict[str, str]] = dict.fromkeys(("dp", "fsdp", "tp"), AXIS)

  def __post_init__(self):
    sizes = (self.dp, self.fsdp, self.tp)
    if any(v == 0 or v < -1 for v in sizes) or sizes.count(-1) > 1:
      raise ValueError(
        f"mesh.dp, mesh.fsdp and mesh.tp must be {self.AXIS}; got dp={self.dp} "
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
  """Where the run writes and what it records: checkpoints, metrics, TensorBoard, W&B, profiles."""

  out_dir: str = "runs/default"  # metrics, checkpoints, the resolved config
  checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
  resume: bool = (
    False  # continue from the newest checkpoint in out_dir (a fresh start if there is none)
  )
  log_every: int = 1  # steps between metric lines (metrics.jsonl, console, sinks)
  tensorboard: bool = True  # TensorBoard scalars under <out_dir>/tb
  progress: bool = True  # a progress bar on the console (process 0)
  host_devices: int | None = None  # simulate this many CPU devices (set before jax starts)
  profile_steps: int = (
    0  # capture a profiler trace of this many GRPO steps (after the compiling first)
  )
  profile_dir: str | None = None  # default: profiles/<basename of out_dir>
  wandb: WandbConfig = WandbConfig()  # noqa: RUF009 (frozen) W&B as a metric sink (rl.logging.wandb_sink)

  RANGES: ClassVar[dict[str, Range]] = {
    "checkpoint_every": Range(ge=0),
    "log_every": Range(ge=1),
    "host_devices": Range(ge=1, optional=True),
    "profile_steps": Range(ge=0),
  }

  def __post_init__(self):
    check_ranges(self, "run")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
  """Multi-process runs: `initialize=true` calls jax.distributed.initialize (null fields: detected from
  the cluster environment, as on TPU pods and SLURM). Every process runs the same command."""

  initialize: bool = False  # call jax.distributed.initialize before anything else
  coordinator_address: str | None = None  # "host:port" of process 0
  num_processes: int | None = None  # processes in the run
  process_id: int | None = None  # this process's index
  cpu_collectives: Literal["gloo", "mpi", "megascale"] = (
    "gloo"  # CPU cross-process collectives (tests run 2 local processes on CPU)
  )

  RANGES: ClassVar[dict[str, Range]] = {
    "num_processes": Range(ge=1, optional=True),
    "process_id": Range(
      ge=0,
      lt=Bound(
        "num_processes", lambda s: s.num_processes if s.num_processes is not None else 2**31
      ),
      optional=True,
    ),
  }

  def __post_init__(self):
    check_ranges(self, "dist")
