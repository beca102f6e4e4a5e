"""Named problem shapes, shared by the tests (parity, AOT lowering) and the benchmarks."""

from __future__ import annotations

import dataclasses
import math


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
class DecoderShape:
  """The parameter shapes of a Qwen2-style decoder (for optimizer benchmarks with no checkpoint)."""

  vocab: int
  hidden: int
  intermediate: int
  layers: int
  heads: int
  kv_heads: int
  tied: bool = True

  def param_shapes(self) -> dict[str, tuple[int, ...]]:
    h, hd = self.hidden, self.hidden // self.heads
    kv = self.kv_heads * hd
    layer = {"q_proj.weight": (h, h), "q_proj.bias": (h,), "k_proj.weight": (h, kv), "k_proj.bias": (kv,),
             "v_proj.weight": (h, kv), "v_proj.bias": (kv,), "o_proj.weight": (h, h),
             "gate_proj.weight": (h, self.intermediate), "up_proj.weight": (h, self.intermediate),
             "down_proj.weight": (self.intermediate, h), "input_layernorm.weight": (h,),
             "post_attention_layernorm.weight": (h,)}
    shapes = {"embed_tokens.weight": (self.vocab, h), "norm.weight": (h,)}
    if not self.tied:
      shapes["lm_head.weight"] = (h, self.vocab)
    for i in range(self.layers):
      shapes.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    return shapes

  def num_params(self) -> int:
    return sum(math.prod(s) for s in self.param_shapes().values())


DECODER_SHAPES: dict[str, DecoderShape] = {
    "tiny": DecoderShape(vocab=1000, hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2),
    "cpu-small": DecoderShape(vocab=8000, hidden=256, intermediate=704, layers=4, heads=4, kv_heads=2),
    "qwen2.5-0.5b": DecoderShape(vocab=151936, hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2),
    "qwen2.5-1.5b": DecoderShape(vocab=151936, hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2),
}
