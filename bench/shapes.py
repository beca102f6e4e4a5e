"""Named problem shapes, shared by the tests (parity, AOT lowering) and the benchmarks."""

from __future__ import annotations

import dataclasses


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
