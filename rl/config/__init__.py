"""The GRPO run's configuration tree (YAML + `key.sub=value` overrides via `rl.configlib`).

Rollout batch and train batch are separate: each step samples `prompts_per_step` prompts x
`group_size` completions; the update splits those `prompts_per_step * group_size` sequences into
micro-batches (`micro_batch_size` per device x data-parallel devices) and accumulates their gradients,
so `grad_accum_steps` is derived and must divide exactly (checked before anything compiles).

The package: the tree, `GRPOConfig` (here), its sections (rl.config.sections; `train` in
rl.config.train) and the platform table of what `train.policy_loss_impl` means on each platform
(rl.config.platform). The generic YAML / override machinery is rl.configlib, outside this package:
rl.model and rl.data.tokenizer use it and this tree imports them.
"""

from __future__ import annotations

import dataclasses

from kernels.loss_spec import LossSpec
from rl.config.sections import (
  DTYPES,
  DataSection,
  DistributedSection,
  EnvSection,
  EvalSection,
  MeshSection,
  ModelSection,
  RewardSection,
  RunSection,
  SamplingSection,
)
from rl.config.train import IsMode, TrainSection
from rl.rollout.config import EngineConfig

# The sections, as rl.config always offered them (rl.run.setup, tests).
__all__ = ["DTYPES", "DataSection", "DistributedSection", "EnvSection", "EvalSection", "IsMode"]
__all__ += ["MeshSection", "ModelSection", "RewardSection", "RunSection", "SamplingSection"]
__all__ += ["AGENT_ONLY", "TRAIN_ONLY", "GRPOConfig", "TrainSection", "check_entry"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """The run's configuration tree: one section per concern, each checked when it is built.

  Across sections, checked before anything compiles: a group fits the rollout engine
  (``sampling.group_size <= rollout.max_slots``, and the paged pool holds a group of the longest
  prompt), ``sampling.max_new_tokens < rollout.max_seq_len``, some reward weight is not 0, and the
  micro-batches divide the step's sequences (``grad_accum_steps``, ``sft_accum_steps``). Keys read by
  one entry point only (``AGENT_ONLY``, ``TRAIN_ONLY``) are an error under the other
  (``check_entry``)."""

  model: ModelSection = ModelSection()  # noqa: RUF009 (frozen)
  data: DataSection = DataSection()  # noqa: RUF009 (frozen)
  rollout: EngineConfig = EngineConfig(max_seq_len=256, max_slots=64, page_size=16)  # noqa: RUF009 (frozen)
  sampling: SamplingSection = SamplingSection()  # noqa: RUF009 (frozen)
  reward: RewardSection = RewardSection()  # noqa: RUF009 (frozen)
  train: TrainSection = TrainSection()  # noqa: RUF009 (frozen)
  eval: EvalSection = EvalSection()  # noqa: RUF009 (frozen)
  mesh: MeshSection = MeshSection()  # noqa: RUF009 (frozen)
  run: RunSection = RunSection()  # noqa: RUF009 (frozen)
  dist: DistributedSection = DistributedSection()  # noqa: RUF009 (frozen)
  env: EnvSection = EnvSection()  # noqa: RUF009 (frozen)

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
    if self.model.batch_invariant and self.rollout.backend == "sglang_jax":
      raise ValueError(
        "model.batch_invariant needs the decoder's own decode: rollout.backend must be paged or "
        "dense, not sglang_jax (it runs its own forward)"
      )
    paged = self.rollout.backend == "paged"
    if self.model.batch_invariant and paged and self.rollout.attn_impl not in ("auto", "xla"):
      raise ValueError(
        "model.batch_invariant needs the model's attention in decode: rollout.attn_impl must be "
        f"'xla' (or 'auto' on CPU), not {self.rollout.attn_impl!r} (a paged kernel's own order)"
      )
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
