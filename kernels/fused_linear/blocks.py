"""Block sizes for the fused LM-head loss: a validated dataclass and the per-backend heuristics."""

from __future__ import annotations

import dataclasses

from kernels import lse
from kernels.backend import Target

CHUNKED_LOGITS_BYTES = 1 << 30  # the chunked path's f32 [chunk, V] logits budget


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


def default_blocks(target: Target, n: int, h: int, v: int) -> LinearBlocks:
  """The heuristic. Why these numbers (TPU; not yet tuned on hardware, none was available):

  * block_n = 256 rows and block_v = 512 vocabulary columns: a 256 x 512 f32 logits tile (512 KiB) is
    MXU-shaped on v5e-v6e (128/256 wide) and its softmax math stays in VMEM.
  * block_h: the largest of 2048 / 1024 / 512 / 256 / 128 dividing H, so at H = 2048 the forward streams
    a bf16 [256, 2048] hidden tile (1 MiB) and a [2048, 512] weight tile (2 MiB), double-buffered, and
    the gradient kernels' f32 accumulators ([256, H] and [H, 512]) stay at 2-4 MiB: inside 16 MiB.
  * CPU interpreter: whole-array-ish tiles, because every grid step costs interpreter overhead.
  """
  block_h = next((b for b in (2048, 1024, 512, 256, 128) if h % b == 0), h)
  if target.platform == "tpu" and not target.interpret:
    return LinearBlocks(
      block_n=n if n <= 256 else 256, block_v=v if v <= 512 else 512, block_h=block_h
    )
  return LinearBlocks(block_n=min(n, 256), block_v=min(v, 2048), block_h=h)


def default_chunk(n: int, v: int) -> int:
  """Tokens per chunk of the chunked path: a power of two with the f32 [chunk, V] logits under 1 GiB
  (1024 tokens at V = 151936), at least 128 and at most N rounded up to a power of two."""
  chunk = 128
  while chunk * 2 * v * 4 <= CHUNKED_LOGITS_BYTES:
    chunk *= 2
  return max(1, min(chunk, 1 << max(n - 1, 0).bit_length()))
