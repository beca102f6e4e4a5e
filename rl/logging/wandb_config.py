"""`run.wandb`: Weights & Biases as a further metric sink beside metrics.jsonl and TensorBoard
(`pip install "grpo-kernels[wandb]"`; the sink is `rl.logging.wandb_sink`). Off by default."""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["MODES", "WandbConfig"]

MODES = ("disabled", "offline", "online")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """mode: disabled (no W&B, wandb not imported), offline (files under <run.out_dir>/wandb/, no
  network, no key; `wandb sync` uploads them later) or online (needs a W&B login or WANDB_API_KEY)."""

  project: str = "grpo-kernels"  # the W&B project the run is logged to
  name: str | None = None  # the W&B run's display name; None: the basename of run.out_dir
  mode: Literal["disabled", "offline", "online"] = "disabled"

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"run.wandb.mode must be one of {list(MODES)}, got {self.mode!r}")
    if not isinstance(self.project, str) or not self.project.strip():
      raise ValueError(f"run.wandb.project must be a non-empty string, got {self.project!r}")
    if self.name is not None and not self.name.strip():
      raise ValueError(f"run.wandb.name must be a non-empty string or null, got {self.name!r}")
