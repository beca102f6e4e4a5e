"""Named problem shapes, shared by the tests (parity, AOT lowering) and the benchmarks."""

from __future__ import annotations

import dataclasses
import jax


@dataclasses.dataclass(frozen=True)
class LossShape:
  """A GRPO loss problem: B sequences of T completion tokens over a vocabulary of V."""

  batch: int
  seq: int
  vocab: int
  dtype: str = "bfloat16"

  @property
  def tokens(self) -> int:
    return self.batch * self.seq


LOSS_SHAPES: dict[str, LossShape] = {
    # CPU interpreter sizes (ragged: V and N are multiples of no block size)
    "tiny": LossShape(3, 7, 1000, "float32"),
    "cpu-small": LossShape(4, 64, 8000, "float32"),
    "cpu-medium": LossShape(8, 128, 32000, "bfloat16"),
    # production sizes: N = 8192 completion tokens
    "qwen2.5-8k": LossShape(8, 1024, 151936, "bfloat16"),
    "llama3-8k": LossShape(8, 1024, 128256, "bfloat16"),
}

PRODUCTION_LOSS_SHAPES = ("qwen2.5-8k", "llama3-8k")


@dataclasses.dataclass(frozen=True)
class LinearLossShape:
  """A fused LM-head loss problem: B x T tokens of hidden size H over a vocabulary of V."""

  batch: int
  seq: int
  hidden: int
  vocab: int
  dtype: str = "bfloat16"

  @property
  def tokens(self) -> int:
    return self.batch * self.seq


LINEAR_LOSS_SHAPES: dict[str, LinearLossShape] = {
    # CPU interpreter sizes (ragged: N and V are multiples of no block)
    "tiny": LinearLossShape(2, 7, 64, 1000, "float32"),
    "cpu-small": LinearLossShape(4, 64, 128, 4000, "float32"),
    "cpu-mid": LinearLossShape(8, 256, 64, 16000, "bfloat16"),  # N >> H: [N, V] dwarfs [H, V]
    # production: Qwen2.5-3B's head (H = 2048, V = 151936) at 8k and 16k completion tokens
    "qwen2.5-3b-8k": LinearLossShape(8, 1024, 2048, 151936, "bfloat16"),
    "qwen2.5-3b-16k": LinearLossShape(16, 1024, 2048, 151936, "bfloat16"),
}

PRODUCTION_LINEAR_LOSS_SHAPES = ("qwen2.5-3b-8k", "qwen2.5-3b-16k")


def decoder_param_shapes(name: str) -> dict[str, tuple[int, ...]]:
  """Parameter name -> shape of the `rl.model` preset `name` (nothing materialised): the optimizer
  benchmarks' parameter tree, at real model sizes with no checkpoint."""
  from flax import nnx

  from rl.model import abstract_model, preset
  from rl.model.partition import path_name

  state = nnx.state(abstract_model(preset(name)), nnx.Param)
  return {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(state)}
