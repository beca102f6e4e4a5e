"""The GRPO run's configuration tree (YAML + `key.sub=value` overrides via `rl.configlib`).

Rollout batch and train batch are separate: each step samples `prompts_per_step` prompts x
`group_size` completions; the update splits those `prompts_per_step * group_size` sequences into
micro-batches (`micro_batch_size` per device x data-parallel devices) and accumulates their gradients,
so `grad_accum_steps` is derived and must divide exactly (checked before anything compiles).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rl.rollout.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class ModelSection:
  preset: str = "tiny"  # rl.model presets; ignored when `checkpoint` is set
  checkpoint: str | None = None  # a local HF directory (config.json + *.safetensors)
  tokenizer: str | None = None  # a directory with tokenizer.json; None: the checkpoint's, else embedded
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class DataSection:
  dataset: Literal["synthetic", "gsm8k"] = "synthetic"
  path: str | None = None  # gsm8k: a directory with train.jsonl / test.jsonl
  template: str = "compact"  # rl.prompts.TEMPLATES
  train_limit: int | None = None
  eval_limit: int | None = None


@dataclasses.dataclass(frozen=True)
class SamplingSection:
  group_size: int = 8  # completions per prompt (the GRPO group)
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 64

  def __post_init__(self):
    if self.group_size < 2:
      raise ValueError(f"group_size must be >= 2 (advantages compare samples of a prompt), got {self.group_size}")
    if self.temperature <= 0:
      raise ValueError(f"training rollouts need temperature > 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = 20
  prompts_per_step: int = 8
  micro_batch_size: int = 16  # sequences per device per micro-batch
  ppo_epochs: int = 1  # > 1 makes the clipping matter (old log-probs are recorded)
  policy_loss_impl: Literal["pallas", "chunked", "xla", "auto"] = "auto"
  fused_lm_head: bool = False
  loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
  beta: float = 0.0  # KL weight; a reference model is kept only when > 0
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  optimizer: Literal["adamw", "lion"] = "adamw"
  fused_optimizer: bool = True
  learning_rate: float = 1e-5
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  warmup_sft_steps: int = 0
  seed: int = 0

  def __post_init__(self):
    for name in ("steps", "prompts_per_step", "micro_batch_size", "ppo_epochs"):
      if getattr(self, name) < 1:
        raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
    if self.beta < 0 or self.epsilon_low < 0 or self.epsilon_high < 0 or self.learning_rate <= 0:
      raise ValueError("beta and epsilons must be >= 0 and learning_rate > 0")


@dataclasses.dataclass(frozen=True)
class EvalSection:
  every: int = 0  # steps between sampled evals (0: off)
  batch: int = 32  # prompts in a sampled eval
  full_every: int = 0  # steps between eval_full runs (0: only at the end, if full_at_end)
  full_at_end: bool = True


@dataclasses.dataclass(frozen=True)
class MeshSection:
  dp: int = 1
  fsdp: int = 1
  tp: int = 1


@dataclasses.dataclass(frozen=True)
class RunSection:
  out_dir: str = "runs/default"
  checkpoint_every: int = 0  # 0: only at the end
  resume: bool = False
  log_every: int = 1


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  model: ModelSection = ModelSection()
  data: DataSection = DataSection()
  rollout: EngineConfig = EngineConfig(max_seq_len=256, max_slots=64, page_size=16)
  sampling: SamplingSection = SamplingSection()
  train: TrainSection = TrainSection()
  eval: EvalSection = EvalSection()
  mesh: MeshSection = MeshSection()
  run: RunSection = RunSection()

  def __post_init__(self):
    if self.sampling.group_size > self.rollout.max_slots:
      raise ValueError(f"sampling.group_size={self.sampling.group_size} exceeds rollout.max_slots="
                       f"{self.rollout.max_slots}: a group is decoded together")
    self.grad_accum_steps  # noqa: B018 (validates)

  @property
  def sequences_per_step(self) -> int:
    return self.train.prompts_per_step * self.sampling.group_size

  @property
  def global_micro_batch(self) -> int:
    return self.train.micro_batch_size * self.mesh.dp * self.mesh.fsdp

  @property
  def grad_accum_steps(self) -> int:
    n, mb = self.sequences_per_step, self.global_micro_batch
    if n % mb:
      raise ValueError(f"prompts_per_step x group_size = {n} sequences do not split into micro-batches of "
                       f"{mb} (train.micro_batch_size={self.train.micro_batch_size} x dp*fsdp="
                       f"{self.mesh.dp * self.mesh.fsdp}); pick sizes that divide")
    return n // mb
