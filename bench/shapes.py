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


def decoder_param_shapes(name: str) -> dict[str, tuple[int, ...]]:
  """Parameter name -> shape of the `rl.model` preset `name` (nothing materialised): the optimizer
  benchmarks' parameter tree, at real model sizes with no checkpoint."""
  from flax import nnx

  from rl.model import abstract_model, preset
  from rl.model.partition import path_name

  state = nnx.state(abstract_model(preset(name)), nnx.Param)
  return {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(state)}
