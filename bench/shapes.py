"""Named problem shapes, shared by the tests (parity, AOT lowering) and the benchmarks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


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
  # vocabularies whose whole-row blocks outgrow v4's 16 MiB of VMEM (N = 4096: issue 52's targets):
  # f32 logits as trainers commonly hand them, and a Gemma-size vocabulary in bf16
  "llama3-f32-4k": LossShape(4, 1024, 128256, "float32"),
  "qwen2.5-f32-4k": LossShape(4, 1024, 151936, "float32"),
  "gemma-262k-4k": LossShape(4, 1024, 262144, "bfloat16"),
  # a vocabulary that is not a multiple of 128 lanes (the in-kernel gather's tail window)
  "ragged-32001": LossShape(4, 128, 32001, "bfloat16"),
}

PRODUCTION_LOSS_SHAPES = ("qwen2.5-8k", "llama3-8k")
LARGE_VOCAB_LOSS_SHAPES = ("llama3-f32-4k", "qwen2.5-f32-4k", "gemma-262k-4k")


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


@dataclasses.dataclass(frozen=True)
class PagedShape:
  """A paged decode-attention problem: `batch` sequences of up to `ctx` cached tokens."""

  batch: int
  q_heads: int
  kv_heads: int
  head_dim: int
  ctx: int
  page_size: int
  dtype: str = "bfloat16"

  @property
  def pages_per_seq(self) -> int:
    return -(-self.ctx // self.page_size)

  def lengths(self) -> list[int]:
    """Fixed, varied lengths in (3/4 ctx, ctx], none a multiple of the page size unless ctx is: a
    realistic mid-rollout batch whose KV bytes are known before any array exists."""
    span = max(self.ctx // 4, 1)
    return [self.ctx - (b * 37 + 1) % span for b in range(self.batch)]

  def kv_bytes(self) -> int:
    """K and V bytes the op must read: every cached token of every kv head, once."""
    return (
      2
      * sum(self.lengths())
      * self.kv_heads
      * self.head_dim
      * np.dtype(jnp.dtype(self.dtype)).itemsize
    )


PAGED_SHAPES: dict[str, PagedShape] = {
  "tiny": PagedShape(3, 4, 2, 16, 40, 8, "float32"),
  "cpu-small": PagedShape(8, 8, 2, 64, 512, 16, "bfloat16"),
  # production: the decode size (a Qwen2.5-1.5B-like GQA layer, 4k context), and a long one
  "decode-4k": PagedShape(64, 16, 2, 128, 4096, 16, "bfloat16"),
  "decode-16k-b8": PagedShape(8, 16, 2, 128, 16384, 16, "bfloat16"),
}

PRODUCTION_PAGED_SHAPES = ("decode-4k", "decode-16k-b8")


def decoder_param_shapes(name: str) -> dict[str, tuple[int, ...]]:
  """Per-tensor parameter name -> shape of the `rl.model` preset `name` (nothing materialised): the
  optimizer benchmarks' parameter tree, at real model sizes with no checkpoint. One leaf per HF tensor
  (`layers.3.mlp.up_proj.kernel`, ~290 for the 0.5B), as a per-tensor optimizer sees a checkpoint,
  though the model itself stores its layers stacked."""
  from flax import nnx

  from rl.model import abstract_model, preset
  from rl.model.partition import path_name, per_layer

  state = nnx.state(abstract_model(preset(name)), nnx.Param)
  before, layers, after = {}, {}, {}  # in tree order, the layers one after another (as HF's)
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    for layer_name, i in per_layer(path_name(path), x.shape[0]):
      if i is None:
        (after if layers else before)[layer_name] = tuple(x.shape)
      else:
        layers[(i, layer_name)] = tuple(x.shape[1:])
  return {**before, **{n: layers[(i, n)] for i, n in sorted(layers)}, **after}
