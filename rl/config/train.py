"""The `train` section of the run's configuration tree: the update's batch, loss, optimizer, schedule,
warm-up and (rl.agent) PPO settings, each range-checked at load."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from kernels.loss_spec import DEFAULT_MAX_LOG_RATIO, IS_MODES
from rl.config.platform import CHOICES as LOSS_IMPL_CHOICES
from rl.configlib import Range, check_ranges
from rl.model.qwen import REMAT

# train.policy_loss_impl: "auto" and every impl the loss ops' tables offer somewhere (rl.config.platform)
PolicyLossImpl = Literal[LOSS_IMPL_CHOICES]

__all__ = ["IsMode", "TrainSection"]

IsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclasses.dataclass(frozen=True)
class TrainSection:
  """The update: batch, loss (kernels.LossSpec's fields), optimizer, schedule, SFT warm-up and the
  multi-turn runs' PPO settings."""

  steps: int = 20  # GRPO steps (each: rollout, rewards, advantages, ppo_epochs updates)
  prompts_per_step: int = 8  # prompts sampled per step; each gets sampling.group_size completions
  micro_batch_size: int = 16  # sequences per device per micro-batch
  ppo_epochs: int = 1  # > 1 makes the clipping matter (old log-probs are recorded)
  # rl.config.platform.LOSS_IMPLS maps each choice to the kernel impl of the platform (pallas: this
  # project's kernel there); a choice the platform lacks is an error at load.
  policy_loss_impl: PolicyLossImpl = "auto"
  fused_lm_head: bool = False  # the loss from hidden states and the LM head (no [B, T, V] logits)
  # Rematerialisation of the decoder layers in the update's backward (rl.model.qwen.REMAT): none
  # keeps every layer's intermediates; layer recomputes each layer keeping its weight matmuls'
  # outputs; full recomputes each layer from its input (the least memory: one more decoder forward
  # per update). The TPU configs set full: it is what lets their micro-batches fit (python -m rl.train
  # --check); the default keeps the GPU / CPU runs' measured step times (no extra forward).
  remat: Literal["none", "layer", "full"] = "none"
  loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"  # the reduction (kernels.LossSpec)
  beta: float = 0.0  # KL weight; a reference model is kept only when > 0
  epsilon_low: float = 0.2  # the PPO clip range's lower side: ratio >= 1 - epsilon_low
  epsilon_high: float = 0.2  # its upper side: ratio <= 1 + epsilon_high (DAPO's clip-higher)
  # The mismatch-aware loss (kernels.LossSpec; docs/grpo_loss.md gives the formulas). The rollout engine's
  # log-probs always reach the loss; is_mode corrects for them (TIS / MIS), null: off.
  is_mode: IsMode | None = None
  is_cap: float = 2.0  # the importance weight's truncation / masking threshold
  importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO
  epsilon_c: float | None = None  # dual-clip PPO (> 1); null: off
  # With a filtering sampler (sampling.top_k / top_p / min_p), score each token over the set it was
  # drawn from (kernels.support: the engine's support gaps, or replayed on the old policy's logits
  # for sglang_jax) in the old, reference and current log-probs; false: the full softmax, which
  # biases the ratio by log(kept mass). No effect when the sampler does not filter.
  score_sampled_support: bool = True
  max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO  # clamp before exp; null: off
  optimizer: Literal["adamw", "lion"] = "adamw"  # the update rule (kernels.optim / optax)
  fused_optimizer: bool = True  # kernels.optim's one-pass update (false: optax's)
  learning_rate: float = 1e-5  # the RL phase's peak learning rate
  weight_decay: float = 0.0  # decoupled weight decay
  max_grad_norm: float = 1.0  # global-norm gradient clipping
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
  seed: int = 0  # everything random is a function of (seed, step)
  # An update whose loss or gradient norm is not finite is skipped (weights and optimizer state kept);
  # this many skipped steps in a row stop the run with an error.
  max_nonfinite_steps: int = 3
  # Multi-turn runs (python -m rl.agent): grpo = group-normalised episode returns on every model
  # token; ppo = GAE advantages from a value head trained with a clipped value loss.
  algorithm: Literal["grpo", "ppo"] = "grpo"
  vf_coef: float = 0.1  # weight of the value loss (ppo)
  value_clip: float | None = 0.2  # clip range of the value loss around the old values; None: off
  gamma: float = 1.0  # GAE discount per model token
  gae_lambda: float = 0.95  # GAE's lambda (ppo)
  whiten_advantages: bool = True  # ppo: whiten GAE advantages over the step's model tokens
  # ppo: head = one linear layer on the policy's final hidden states (its value gradient reaches the
  # policy's trunk); model = a separate transformer with its own head (rl.agent.critic.CriticModel).
  critic: Literal["head", "model"] = "head"
  # critic=model: its rl.model preset (it shares the tokenizer); null: a copy of the policy's
  # initial weights.
  critic_preset: str | None = None

  RANGES: ClassVar[dict[str, Range]] = {
    "steps": Range(ge=1),
    "prompts_per_step": Range(ge=1),
    "micro_batch_size": Range(ge=1),
    "ppo_epochs": Range(ge=1),
    "beta": Range(ge=0),
    # The clip range is [1 - epsilon_low, 1 + epsilon_high]: a ratio is never negative.
    "epsilon_low": Range(ge=0, lt=1),
    "epsilon_high": Range(ge=0),
    "is_cap": Range(gt=0),
    "epsilon_c": Range(gt=1, optional=True),
    "max_log_ratio": Range(gt=0, optional=True),
    "learning_rate": Range(gt=0),
    "weight_decay": Range(ge=0),
    "max_grad_norm": Range(ge=0),  # 0: no clipping
    "lr_warmup_steps": Range(ge=0),
    "warmup_sft_steps": Range(ge=0),
    "sft_learning_rate": Range(gt=0, optional=True),
    "sft_batch_size": Range(ge=0),
    "seed": Range(ge=0, lt=2**31),  # seeds become uint32 sampling keys
    "max_nonfinite_steps": Range(ge=1),
    "vf_coef": Range(ge=0),
    "value_clip": Range(gt=0, optional=True),
    "gamma": Range(ge=0, le=1),
    "gae_lambda": Range(ge=0, le=1),
  }

  def __post_init__(self):
    check_ranges(self, "train")
    if self.is_mode not in IS_MODES:
      raise ValueError(f"train.is_mode must be one of {list(IS_MODES)}, got {self.is_mode!r}")
    if self.importance_sampling_level not in ("token", "sequence"):
      raise ValueError(
        "train.importance_sampling_level must be one of ['token', 'sequence'], got "
        f"{self.importance_sampling_level!r}"
      )
    if self.lr_schedule not in ("constant", "cosine"):
      raise ValueError(f"train.lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
    if self.algorithm not in ("grpo", "ppo"):
      raise ValueError(f"train.algorithm must be grpo or ppo, got {self.algorithm!r}")
    if self.critic not in ("head", "model"):
      raise ValueError(f"train.critic must be head or model, got {self.critic!r}")
    if self.critic_preset is not None and self.critic != "model":
      raise ValueError(
        "train.critic_preset is the separate critic's preset: set train.critic=model"
      )
    if self.remat not in REMAT:
      raise ValueError(f"train.remat must be one of {list(REMAT)}, got {self.remat!r}")
    if self.policy_loss_impl == "chunked" and not self.fused_lm_head:
      raise ValueError(
        "train.policy_loss_impl=chunked is a fused LM-head path: set train.fused_lm_head=true"
      )
