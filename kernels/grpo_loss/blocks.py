"""Block sizes for the GRPO loss kernels: a validated dataclass and a heuristic per backend."""

from __future__ import annotations

import dataclasses

from kernels import lse
from kernels.backend import Target


@dataclasses.dataclass(frozen=True)
class LossBlocks:
  """Tile sizes over (tokens, vocabulary).

  block_n: token rows per program (the GPU ``rowloop`` family handles exactly one row per program).
  block_v: vocabulary columns per tile (tiled family) or per loop chunk (rowloop family).
  num_warps, num_stages: Triton launch parameters, ignored elsewhere.
  """

  block_n: int
  block_v: int
  num_warps: int = 8
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_n", "block_v", "num_warps", "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"LossBlocks.{name} must be a positive int, got {value!r}")

  def check(self, target: Target, n: int, v: int) -> None:
    """Raise ValueError unless these blocks are legal for ``target`` at an [n, v] problem."""
    if target.family == "rowloop":
      if self.block_n != 1:
        raise ValueError(
          f"the GPU (rowloop) kernel runs one row per program: block_n must be 1, got {self.block_n}"
        )
      lse.check_triton_tile("block_v", self.block_v)
      return
    if target.platform == "tpu" and not target.interpret:
      lse.check_tpu_tile("block_n", self.block_n, n, 8, "N")
      lse.check_tpu_tile("block_v", self.block_v, v, 128, "V")


def default_blocks(target: Target, n: int, v: int) -> LossBlocks:
  """The heuristic. Why these numbers:

  * TPU: 128 x 2048 tiles keep a bf16 logits tile at 512 KiB (double-buffered by the pipeline) and the
    f32 temporaries of one tile at about 1 MiB each, well inside the default scoped VMEM of v4-v6; the
    vocabulary tail is masked in-kernel, so V = 151936 (= 74 * 2048 + 384) needs no padding.
  * GPU: one row per program (8192 programs at N = 8192 fill every SM several times over) streaming the
    row in 4096-wide chunks with 8 warps: 16 contiguous elements per thread per load. Not yet tuned on
    hardware; see bench/results for what was measured.
  * CPU interpreter: large tiles, because each grid step costs interpreter overhead.
  """
  if target.family == "rowloop":
    return LossBlocks(block_n=1, block_v=min(4096, 1 << max(v - 1, 0).bit_length()), num_warps=8)
  if target.platform == "tpu" and not target.interpret:
    return LossBlocks(block_n=n if n <= 128 else 128, block_v=v if v <= 2048 else 2048)
  return LossBlocks(block_n=min(n, 256), block_v=min(v, 4096))
