"""The GRPO run's configuration tree (YAML + `key.sub=value` overrides via `rl.configlib`).

Rollout batch and train batch are separate: each step samples `prompts_per_step` prompts x
`group_size` completions; the update splits those `prompts_per_step * group_size` sequences into
micro-batches (`micro_batch_size` per device x data-parallel devices) and accumulates their gradients,
so `grad_accum_steps` is derived and must divide exactly (checked before anything compiles).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kernels.loss_spec import DEFAULT_MAX_LOG_RATIO, IS_MODES, LossSpec
from rl.configlib import check_range
from rl.data.synthetic import LEVELS
from rl.env.grid import OBSERVATIONS as GRID_OBSERVATIONS
from rl.prompts import TEMPLATES
from rl.rollout.config import EngineConfig
from rl.wandb_config import WandbConfig

DTYPES = ("float32", "bfloat16", "float16")
IsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


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
  template: str = "compact"  # rl.prompts.TEMPLATES
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
  """Weights of the reward functions (rl.rewards.REWARD_FNS); the total is the weighted sum."""

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
class TrainSection:
  steps: int = 20
  prompts_per_step: int = 8
  micro_batch_size: int = 16  # sequences per device per micro-batch
  ppo_epochs: int = 1  # > 1 makes the clipping matter (old log-probs are recorded)
  # rl.platform.LOSS_IMPLS maps each choice to the kernel impl of the platform (pallas: this
  # project's kernel there); a choice the platform lacks is an error at load.
  policy_loss_impl: Literal["pallas", "chunked", "xla", "auto", "mosaic_gpu"] = "auto"
  fused_lm_head: bool = False
  loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
  beta: float = 0.0  # KL weight; a reference model is kept only when > 0
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  # The mismatch-aware loss (kernels.LossSpec; the README gives the formulas). The rollout engine's
  # log-probs always reach the loss; is_mode corrects for them (TIS / MIS), null: off.
  is_mode: IsMode | None = None
  is_cap: float = 2.0  # the importance weight's truncation / masking threshold
  importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO
  epsilon_c: float | None = None  # dual-clip PPO (> 1); null: off
  max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO  # clamp before exp; null: off
  optimizer: Literal["adamw", "lion"] = "adamw"
  fused_optimizer: bool = True
  learning_rate: float = 1e-5
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  # Linear warm-up of the learning rate over each optimizer's first updates (the SFT warm-up's and
  # the RL phase's, counted separately); 0: constant from the first step.
  lr_warmup_steps: int = 0
  # cosine: after the warm-up, decay to a tenth of the rate by the phase's last update (the SFT
  # warm-up's warmup_sft_steps, the RL phase's steps); constant: no decay.
  lr_schedule: Literal["constant", "cosine"] = "constant"
  warmup_sft_steps: int = 0  # supervised steps on the train split's worked solutions before GRPO
  sft_learning_rate: float | None = None  # None: learning_rate
  # Worked solutions per SFT step; 0: prompts_per_step x group_size. Smaller batches mean more
  # updates per second on CPU, which is what a short warm-up needs.
  sft_batch_size: int = 0
  seed: int = 0
  # An update whose loss or gradient norm is not finite is skipped (weights and optimizer state kept);
  # this many skipped steps in a row stop the run with an error.
  max_nonfinite_steps: int = 3
  # Multi-turn runs (python -m rl.agent): grpo = group-normalised episode returns on every model
  # token; ppo = GAE advantages from a value head trained with a clipped value loss.
  algorithm: Literal["grpo", "ppo"] = "grpo"
  vf_coef: float = 0.1  # weight of the value loss (ppo)
  value_clip: float | None = 0.2  # clip range of the value loss around the old values; None: off
  gamma: float = 1.0  # GAE discount per model token
  gae_lambda: float = 0.95
  whiten_advantages: bool = True  # ppo: whiten GAE advantages over the step's model tokens
  # ppo: head = one linear layer on the policy's final hidden states (its value gradient reaches the
  # policy's trunk); model = a separate transformer with its own head (rl.critic.CriticModel).
  critic: Literal["head", "model"] = "head"
  # critic=model: its rl.model preset (it shares the tokenizer); null: a copy of the policy's
  # initial weights.
  critic_preset: str | None = None

  def __post_init__(self):
    for name in ("steps", "prompts_per_step", "micro_batch_size", "ppo_epochs"):
      check_range(f"train.{name}", getattr(self, name), ge=1)
    check_range("train.learning_rate", self.learning_rate, gt=0)
    check_range("train.sft_learning_rate", self.sft_learning_rate, gt=0, optional=True)
    check_range("train.beta", self.beta, ge=0)
    # The clip range is [1 - epsilon_low, 1 + epsilon_high]: a ratio is never negative.
    check_range("train.epsilon_low", self.epsilon_low, ge=0, lt=1)
    check_range("train.epsilon_high", self.epsilon_high, ge=0)
    if self.is_mode not in IS_MODES:
      raise ValueError(f"train.is_mode must be one of {list(IS_MODES)}, got {self.is_mode!r}")
    if self.importance_sampling_level not in ("token", "sequence"):
      raise ValueError(
        "train.importance_sampling_level must be one of ['token', 'sequence'], got "
        f"{self.importance_sampling_level!r}"
      )
    check_range("train.is_cap", self.is_cap, gt=0)
    check_range("train.epsilon_c", self.epsilon_c, gt=1, optional=True)
    check_range("train.max_log_ratio", self.max_log_ratio, gt=0, optional=True)
    check_range("train.weight_decay", self.weight_decay, ge=0)
    check_range("train.max_grad_norm", self.max_grad_norm, ge=0)  # 0: no clipping
    check_range("train.lr_warmup_steps", self.lr_warmup_steps, ge=0)
    if self.lr_schedule not in ("constant", "cosine"):
      raise ValueError(f"train.lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
    check_range("train.warmup_sft_steps", self.warmup_sft_steps, ge=0)
    check_range("train.sft_batch_size", self.sft_batch_size, ge=0)
    check_range("train.seed", self.seed, ge=0, lt=2**31)  # seeds become uint32 sampling keys
    check_range("train.max_nonfinite_steps", self.max_nonfinite_steps, ge=1)
    if self.algorithm not in ("grpo", "ppo"):
      raise ValueError(f"train.algorithm must be grpo or ppo, got {self.algorithm!r}")
    check_range("train.vf_coef", self.vf_coef, ge=0)
    check_range("train.value_clip", self.value_clip, gt=0, optional=True)
    check_range("train.gamma", self.gamma, ge=0, le=1)
    check_range("train.gae_lambda", self.gae_lambda, ge=0, le=1)
    if self.critic not in ("head", "model"):
      raise ValueError(f"train.critic must be head or model, got {self.critic!r}")
    if self.critic_preset is not None and self.critic != "model":
      raise ValueError(
        "train.critic_preset is the separate critic's preset: set train.critic=model"
      )
    if self.policy_loss_impl == "chunked" and not self.fused_lm_head:
      raise ValueError(
        "train.policy_loss_impl=chunked is a fused LM-head path: set train.fused_lm_head=true"
      )


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
  """Mesh axis sizes; one may be -1 (the devices left). Without -1 the first dp*fsdp*tp devices."""

  dp: int = 1
  fsdp: int = -1
  tp: int = 1

  def __post_init__(self):
    sizes = (self.dp, self.fsdp, self.tp)
    if any(v == 0 or v < -1 for v in sizes) or sizes.count(-1) > 1:
      raise ValueError(
        f"mesh.dp, mesh.fsdp and mesh.tp must be positive, with at most one -1; got dp={self.dp} "
        f"fsdp={self.fsdp} tp={self.tp}"
      )

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
    return MeshSection(*(fill if v == -1 else v for v in (self.dp, self.fsdp, self.tp)))


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
  wandb: WandbConfig = WandbConfig()  # noqa: RUF009 (frozen) W&B as a metric sink (rl.wandb_sink)

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


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  model: ModelSection = ModelSection()
  data: DataSection = DataSection()
  rollout: EngineConfig = EngineConfig(max_seq_len=256, max_slots=64, page_size=16)  # noqa: RUF009 (frozen)
  sampling: SamplingSection = SamplingSection()
  reward: RewardSection = RewardSection()
  train: TrainSection = TrainSection()
  eval: EvalSection = EvalSection()
  mesh: MeshSection = MeshSection()
  run: RunSection = RunSection()
  dist: DistributedSection = DistributedSection()
  env: EnvSection = EnvSection()

  def __post_init__(self):
    if self.sampling.group_size > self.rollout.max_slots:
      raise ValueError(
        f"sampling.group_size={self.sampling.group_size} exceeds rollout.max_slots="
        f"{self.rollout.max_slots}: a group is decoded together"
      )
    self.rollout.check_group(self.sampling.group_size, what="sampling.group_size")
    if self.sampling.max_new_tokens >= self.rollout.max_seq_len:
      raise ValueError(
        f"sampling.max_new_tokens={self.sampling.max_new_tokens} leaves no room for a prompt "
        f"within rollout.max_seq_len={self.rollout.max_seq_len}"
      )
    if not self.reward.weights():
      raise ValueError("every reward weight is 0: nothing to learn from")
    if -1 not in (self.mesh.dp, self.mesh.fsdp, self.mesh.tp):
      self.grad_accum_steps  # noqa: B018 (validates now; with a -1 axis once the devices are known)
      self.sft_accum_steps  # noqa: B018

  @property
  def loss_spec(self) -> LossSpec:
    """The policy loss the update computes (the sampling temperature scales the trainer's logits)."""
    t = self.train
    return LossSpec(
      loss_type=t.loss_type,
      epsilon_low=t.epsilon_low,
      epsilon_high=t.epsilon_high,
      beta=t.beta,
      temperature=self.sampling.temperature,
      max_log_ratio=t.max_log_ratio,
      is_mode=t.is_mode,
      is_cap=t.is_cap,
      importance_sampling_level=t.importance_sampling_level,
      epsilon_c=t.epsilon_c,
      max_completion_length=self.sampling.max_new_tokens,
    )

  @property
  def sequences_per_step(self) -> int:
    return self.train.prompts_per_step * self.sampling.group_size

  def resolved(self, num_devices: int) -> GRPOConfig:
    """The config with a concrete mesh for `num_devices` devices (batch sizes validated against it)."""
    return dataclasses.replace(self, mesh=self.mesh.resolve(num_devices))

  @property
  def sft_sequences(self) -> int:
    return self.train.sft_batch_size or self.sequences_per_step

  @property
  def sft_accum_steps(self) -> int:
    """Micro-batches per SFT step: one when the SFT batch fits a micro-batch, else it must divide."""
    n, mb, shards = self.sft_sequences, self.global_micro_batch, self.mesh.dp * self.mesh.fsdp
    if n <= mb and n % shards == 0:
      return 1
    if n % mb:
      raise ValueError(
        f"train.sft_batch_size={n} must be at most one micro-batch ({mb} sequences) and divisible "
        f"by dp*fsdp={shards}, or a multiple of the micro-batch"
      )
    return n // mb

  @property
  def global_micro_batch(self) -> int:
    return self.train.micro_batch_size * self.mesh.dp * self.mesh.fsdp

  @property
  def grad_accum_steps(self) -> int:
    n, mb = self.sequences_per_step, self.global_micro_batch
    if n % mb:
      raise ValueError(
        f"prompts_per_step x group_size = {n} sequences do not split into micro-batches of "
        f"{mb} (train.micro_batch_size={self.train.micro_batch_size} x dp*fsdp="
        f"{self.mesh.dp * self.mesh.fsdp}); pick sizes that divide"
      )
    return n // mb


# Keys only one entry point reads. Set for the other they would be ignored without a word (issue 31:
# `env: calc` under rl.train ran plain single-turn GRPO), so they are an error naming the right one.
AGENT_ONLY = (
  "env",
  "train.algorithm",
  "train.vf_coef",
  "train.value_clip",
  "train.gamma",
  "train.gae_lambda",
  "train.whiten_advantages",
  "train.critic",
  "train.critic_preset",
)
TRAIN_ONLY = (  # the mismatch-aware loss: rl.agent's PPO term does not take it
  "train.is_mode",
  "train.is_cap",
  "train.importance_sampling_level",
  "train.epsilon_c",
  "train.max_log_ratio",
)
ENTRIES = {"rl.train": ("rl.agent", AGENT_ONLY), "rl.agent": ("rl.train", TRAIN_ONLY)}


def check_entry(keys: list[str], entry: str) -> None:
  """ValueError when `keys` (the dotted keys a config sets) hold one the `entry` point
  ("rl.train" / "rl.agent") does not read, naming the entry point that does."""
  other, foreign = ENTRIES[entry]
  unused = [k for k in keys if any(k == f or k.startswith(f + ".") for f in foreign)]
  if unused:
    what = {
      "rl.agent": "multi-turn episodes (env:) and PPO with a critic",
      "rl.train": "the mismatch-aware loss (is_mode, epsilon_c, max_log_ratio, ...)",
    }[other]
    raise ValueError(
      f"{', '.join(unused)}: not read by python -m {entry}, which would ignore "
      f"{'it' if len(unused) == 1 else 'them'}; {what} is python -m {other}'s: use python -m "
      f"{other}, or remove {'it' if len(unused) == 1 else 'them'}"
    )
