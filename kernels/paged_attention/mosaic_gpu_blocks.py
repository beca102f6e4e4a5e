"""Blocks of the Mosaic GPU paged decode-attention kernel (:mod:`kernels.paged_attention.mosaic_gpu`):
the validated dataclass with its shared-memory account and launch plan, the heuristic, and the
kernel's static config."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kernels.backend import Target
from kernels.paged_attention import plan as plan_lib

ROWS = 64  # the wgmma M tile: query heads of one kv head are padded to it
SMEM_BUDGET = 200 * 1024
DTYPES = ("bfloat16", "float16")
TILE_TOKENS = 64  # default K / V tile: 4 pages of 16; 32 KiB of bf16 K + V per stage at D = 128
IDX_COLS = (
  128  # page ids staged as [rows, <= 128] int32 (a bulk copy's box is <= 256 per dimension)
)


@dataclasses.dataclass(frozen=True)
class MosaicPagedBlocks:
  """pages_per_block: pages gathered into one [pages_per_block * page_size, D] key / value tile (a
  multiple of 64 tokens, at most 256: the wgmma N / K extents). num_splits: split-K partitions.
  stages: depth of the K / V ring (``stages - 1`` blocks in flight while one is computed)."""

  pages_per_block: int
  num_splits: int = 1
  stages: int = 4

  def __post_init__(self):
    for name in ("pages_per_block", "num_splits", "stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MosaicPagedBlocks.{name} must be a positive int, got {value!r}")

  def smem_bytes(self, page_size: int, head_dim: int, dtype, pages_per_seq: int = 0) -> int:
    """Shared memory of one CTA: q, the K / V ring, p, the f32 output tile, lse, the page ids (of a
    split of a ``pages_per_seq``-wide page table; 0: not counted)."""
    bk = self.pages_per_block * page_size
    itemsize = jnp.dtype(dtype).itemsize
    tiles = ((ROWS + 2 * self.stages * bk) * head_dim + ROWS * bk) * itemsize
    ids = math.prod(id_shape(pages_per_split(pages_per_seq, self))) if pages_per_seq else 0
    return tiles + ROWS * head_dim * 4 + ROWS * 4 + 4 * ids

  def check(self, page_size: int, head_dim: int, dtype, pages_per_seq: int = 0) -> None:
    bk = self.pages_per_block * page_size
    if bk % 64 or bk > 256:
      raise ValueError(
        f"MosaicPagedBlocks: pages_per_block * page_size must be a multiple of 64 and <= 256, got "
        f"{self.pages_per_block} * {page_size} = {bk}"
      )
    if page_size % 8:
      raise ValueError(f"the Mosaic GPU kernel needs page_size a multiple of 8, got {page_size}")
    smem = self.smem_bytes(page_size, head_dim, dtype, pages_per_seq)
    if smem > SMEM_BUDGET:
      raise ValueError(
        f"MosaicPagedBlocks use {smem} bytes of shared memory (stages={self.stages}, tile {bk} x "
        f"{head_dim}); at most {SMEM_BUDGET}"
      )

  def plan(self, *, batch, kv_heads, head_dim, page_size, pages_per_seq, lengths, dtype):
    """The launch's account (:func:`.plan.launch_plan`); lengths [B] ints."""
    return plan_lib.launch_plan(
      batch=batch,
      kv_heads=kv_heads,
      head_dim=head_dim,
      page_size=page_size,
      pages_per_split=pages_per_split(pages_per_seq, self),
      lengths=lengths,
      itemsize=jnp.dtype(dtype).itemsize,
      pages_per_block=self.pages_per_block,
      num_splits=self.num_splits,
      stages=self.stages,
      smem_per_cta=self.smem_bytes(page_size, head_dim, dtype, pages_per_seq),
    )


def pages_per_split(pages_per_seq: int, blocks: MosaicPagedBlocks) -> int:
  """Pages of one split's part of the page table: a whole number of blocks."""
  ppb = blocks.pages_per_block
  return -(-pages_per_seq // (ppb * blocks.num_splits)) * ppb


def id_shape(pages_per_split: int) -> tuple[int, int]:
  """[rows, cols] of one split's staged ids, padded: cols <= IDX_COLS, a multiple of 32 ids (128
  bytes: jax 0.10 splits a bulk copy evenly over the warpgroup's 128 threads)."""
  rows = -(-pages_per_split // IDX_COLS)
  per_row = -(-pages_per_split // rows)
  cols = -(-per_row // 32) * 32
  return rows, cols


def default_blocks(
  batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int, head_dim: int, dtype
) -> MosaicPagedBlocks:
  """64-token K / V tiles (4 pages of 16), split-K by wave efficiency (:func:`.plan.wave_splits`:
  none once batch x kv heads fills ~80 % of the 132 SMs), and the deepest ring (4 down to 1 stages)
  that fits the shared-memory budget: 4 stages of 32 KiB at D = 128 bf16 (188 KiB per CTA).
  Not tuned on hardware (none was available); the autotuner's cache overrides it per device."""
  ppb = max(1, TILE_TOKENS // page_size)
  while (ppb * page_size) % 64:
    ppb += 1
  splits = plan_lib.wave_splits(batch * num_kv_heads, -(-pages_per_seq // ppb))
  for stages in (4, 3, 2):
    blocks = MosaicPagedBlocks(ppb, splits, stages)
    try:
      blocks.check(page_size, head_dim, dtype, pages_per_seq)
      return blocks
    except ValueError:
      continue
  return MosaicPagedBlocks(ppb, splits, 1)


@dataclasses.dataclass(frozen=True)
class MosaicPagedConfig:
  target: Target
  blocks: MosaicPagedBlocks
  scale: float
