"""Block sizes for the fused LM-head loss: a validated dataclass and the per-backend heuristics."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels import lse
from kernels.backend import Target


@dataclasses.dataclass(frozen=True)
class LinearBlocks:
  """Tiles of the fused Pallas kernels over (tokens, vocabulary, hidden).

  block_h tiles the contraction of the forward kernel (it must divide H); the gradient kernels contract
  over whole hidden rows, so their VMEM holds a [block_n, H] and a [H, block_v] tile.
  """

  block_n: int
  block_v: int
  block_h: int

  def __post_init__(self):
    for name in ("block_n", "block_v", "block_h"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"LinearBlocks.{name} must be a positive int, got {value!r}")

  def check(self, target: Target, n: int, h: int, v: int) -> None:
    """Raise ValueError unless these blocks are legal for ``target`` at an [n, h] x [h, v] problem."""
    if h % self.block_h:
      raise ValueError(f"block_h={self.block_h} must divide H={h}")
    if target.platform == "tpu" and not target.interpret:
      # Mosaic's (8, 128) rule on every block: h [bn, bh], w [bh, bv], per-token [bn, 1].
      lse.check_tpu_tile("block_n", self.block_n, n, 8, "N")
      lse.check_tpu_tile("block_v", self.block_v, v, 128, "V")
      lse.check_tpu_tile("block_h", self.block_h, h, 128, "H")


def kernel_vmem_bytes(blocks: LinearBlocks, h: int, itemsize: int) -> dict[str, int]:
  """VMEM of one grid step of each fused kernel (a model, above the compiler's figures: v4 reports
  18.5 MiB for the dweight step at (256, 512, 2048) bf16, this says 26.2). Inputs and outputs
  double-buffered; [bn, 1] per-token blocks padded to a 128-lane f32 tile; f32 accumulators and the
  f32 dot result they add; ~5 f32 [bn, bv] temporaries (logits, softmax, dl); outputs counted f32
  (the vocabulary-sharded dhidden and the row-sharded dweight are f32 partial sums)."""
  bn, bv, bh = blocks.block_n, blocks.block_v, blocks.block_h
  tile, row = bn * bv * 4, bn * 128 * 4
  return {
    "stats": 2 * (bn * bh + bh * bv) * itemsize + 2 * tile + 5 * tile + 15 * row,
    "dhidden": 2 * (bn * h + h * bv) * itemsize + 2 * bn * h * 4 + 2 * bn * h * 4 + 5 * tile + 6 * row,
    "dweight": 2 * (bn * h + h * bv) * itemsize + 2 * h * bv * 4 + 2 * h * bv * 4 + bn * h * itemsize + 5 * tile + 6 * row,
  }  # fmt: skip


# The TPU heuristic's tiles, best first: the first whose kernels fit the generation's VMEM is taken.
TPU_TILES = ((256, 512), (256, 256), (128, 256), (128, 128))


def default_blocks(target: Target, n: int, h: int, v: int, itemsize: int = 2) -> LinearBlocks:
  """The heuristic. Why these numbers (TPU; not yet tuned on hardware, none was available):

  * block_n = 256 rows and block_v = 512 vocabulary columns: a 256 x 512 f32 logits tile (512 KiB) is
    MXU-shaped on v5e-v6e (128/256 wide) and its softmax math stays in VMEM.
  * block_h: the largest of 2048 / 1024 / 512 / 256 / 128 dividing H, so at H = 2048 the forward streams
    a bf16 [256, 2048] hidden tile (1 MiB) and a [2048, 512] weight tile (2 MiB), double-buffered.
  * The gradient kernels hold [bn, H] and [H, bv] f32 accumulators: at H = 2048 the dweight step
    outgrows v4's 16 MiB of VMEM at (256, 512) (compiled: 18.5 MiB), so each generation takes the
    first of :data:`TPU_TILES` whose kernels fit its VMEM (:func:`kernel_vmem_bytes`): (256, 512)
    on v5e / v5p / v6e / v7x, (256, 256) on v4 and on a TPU target of unknown generation.
  * CPU interpreter: whole-array-ish tiles, because every grid step costs interpreter overhead.
  """
  block_h = next((b for b in (2048, 1024, 512, 256, 128) if h % b == 0), h)
  if target.platform == "tpu" and not target.interpret:
    for bn, bv in TPU_TILES:
      blocks = LinearBlocks(
        block_n=n if n <= bn else bn, block_v=v if v <= bv else bv, block_h=block_h
      )
      if max(kernel_vmem_bytes(blocks, h, itemsize).values()) <= target.vmem_bytes:
        break
    return blocks
  return LinearBlocks(block_n=min(n, 256), block_v=min(v, 2048), block_h=h)


def legal_on(target: Target, blocks: LinearBlocks, shape: dict) -> str | None:
  """Why ``blocks`` cannot compile for ``target`` at ``shape`` (the tuner's dict: tokens, hidden,
  vocab (one shard's), dtype), or None: :meth:`LinearBlocks.check`, and on TPU every fused kernel's
  step within the generation's VMEM (the kernels ask for it with ``vmem_limit_bytes``)."""
  n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
  try:
    blocks.check(target, n, h, v)
  except ValueError as e:
    return str(e)
  if target.platform != "tpu" or target.interpret:
    return None
  need = kernel_vmem_bytes(blocks, h, jnp.dtype(shape["dtype"]).itemsize)
  name, worst = max(need.items(), key=lambda kv: kv[1])
  if worst > target.vmem_bytes:
    return (
      f"TPU {target.generation or '(any generation)'}: the {name} kernel's step needs "
      f"~{worst / 2**20:.1f} MiB of VMEM at {blocks}, over the {target.vmem_bytes / 2**20:.0f} MiB "
      "there (a smaller block_v or block_n fits)"
    )
  return None
