"""Block sizes for paged decode attention: a validated dataclass and the per-backend heuristic."""

from __future__ import annotations

import dataclasses

from kernels.backend import Target

GPU_SM_TARGET = 264  # programs to keep ~2 per SM busy on an H100 (132 SMs)


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
  """How one (sequence, kv head) walks its pages.

  pages_per_block: pages whose keys form one [pages_per_block * page_size, D] score tile.
  num_splits: split-K partitions of the page list, run in parallel and merged exactly (log-sum-exp);
    they add parallelism when batch x kv heads is too small to fill the chip at long contexts.
  """

  pages_per_block: int
  num_splits: int = 1

  def __post_init__(self):
    for name in ("pages_per_block", "num_splits"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"PagedBlocks.{name} must be a positive int, got {value!r}")

  def check(self, target: Target, page_size: int, head_dim: int, dtype_bytes: int) -> None:
    """Raise ValueError unless these blocks are legal for ``target``."""
    if target.platform == "gpu" and self.pages_per_block & (self.pages_per_block - 1):
      raise ValueError(f"GPU pages_per_block must be a power of two, got {self.pages_per_block}")
    if target.platform == "gpu" and page_size & (page_size - 1):
      raise ValueError(f"the GPU kernel needs a power-of-two page_size, got {page_size}")
    if target.platform == "gpu" and self.pages_per_block * page_size < 16:
      raise ValueError(
        "the GPU kernel needs pages_per_block * page_size >= 16 (Triton dot minimum)"
      )
    if target.platform == "tpu" and not target.interpret:
      # Mosaic's rule on each [page_size, D] page block: sublanes in units of 32 bits / dtype bytes * 8.
      sublanes = 8 * (4 // dtype_bytes)
      if page_size % sublanes:
        raise ValueError(
          f"TPU page_size must be a multiple of {sublanes} for this dtype, got {page_size}"
        )
      if head_dim % 128:
        raise ValueError(f"TPU head_dim must be a multiple of 128, got {head_dim}")


def default_blocks(
  target: Target, batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int
) -> PagedBlocks:
  """The heuristic. Why these numbers (not yet tuned on hardware; none was available):

  * GPU: a 128-token key tile (pages_per_block * page_size, at least 16 for the Triton dot), and split-K
    until batch x kv heads x splits reaches ~2 programs per H100 SM — decode is bandwidth-bound, so the
    goal is enough loads in flight, not arithmetic.
  * TPU: 512 tokens per grid step (each page its own double-buffered DMA), one split: the grid's batch
    and kv-head axes are parallel, which already spreads over megacore's two TensorCores.
  * CPU interpreter: the whole page list in one step, because each grid step costs interpreter overhead.
  """
  if target.platform == "gpu":
    ppb = max(1, min(_pow2_floor(max(128 // page_size, 1)), _pow2_ceil(pages_per_seq)))
    while ppb * page_size < 16:
      ppb *= 2
    blocks_total = -(-pages_per_seq // ppb)
    splits = 1
    while batch * num_kv_heads * splits < GPU_SM_TARGET and splits * 2 <= blocks_total:
      splits *= 2
    return PagedBlocks(ppb, splits)
  if target.platform == "tpu" and not target.interpret:
    return PagedBlocks(max(1, min(512 // page_size, pages_per_seq)), 1)
  return PagedBlocks(max(1, min(pages_per_seq, 64)), 1)


def _pow2_floor(x: int) -> int:
  return 1 << (x.bit_length() - 1)


def _pow2_ceil(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()
