"""Blocks of the optimizers' ``pallas`` impl, one class per kernel family: ``ElementwiseBlocks`` for
the tiled family's windows (:mod:`kernels.optim.pallas_tpu`) and ``MultiTensorBlocks`` for the GPU
(Triton) family's (leaf, chunk) walk (:mod:`kernels.optim.pallas_triton`), with that walk's heuristic
and the autotuner's grid."""

from __future__ import annotations

import dataclasses

from kernels.optim.pallas_tpu_plan import LANES


@dataclasses.dataclass(frozen=True)
class ElementwiseBlocks:
  """The largest window per array: ``block_cols`` columns at most (wider rows are split in column
  windows), ``block_rows x block_cols`` elements (narrower leaves take more rows); None: sized from
  the target's VMEM. ``num_warps`` is unused (kept for old callers and cached tuning entries)."""

  block_rows: int
  block_cols: int
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block_rows", "block_cols", "num_warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ElementwiseBlocks.{name} must be a positive int, got {value!r}")
    if self.block_cols % LANES:
      raise ValueError(f"ElementwiseBlocks.block_cols must be a multiple of 128, got {self.block_cols}")  # fmt: skip
    if self.block_rows % 8:
      raise ValueError(f"ElementwiseBlocks.block_rows must be a multiple of 8, got {self.block_rows}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MultiTensorBlocks:
  """block: elements per step (a power of two, 128..16384); chunk: elements per program, a multiple
  of block (at most 64 steps); num_warps: 1, 2, 4, 8 or 16. Elements per thread per array =
  block / (32 num_warps), at most 64 (the registers a step keeps live)."""

  block: int = 1024
  chunk: int = 4096
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block", "chunk", "num_warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MultiTensorBlocks.{name} must be a positive int, got {value!r}")
    if self.block & (self.block - 1) or not 128 <= self.block <= 16384:
      raise ValueError(
        f"MultiTensorBlocks.block must be a power of two in [128, 16384], got {self.block}"
      )
    if self.chunk % self.block or not 1 <= self.chunk // self.block <= 64:
      raise ValueError(
        f"MultiTensorBlocks.chunk must be block x (1..64), got chunk={self.chunk}, block={self.block}"
      )
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(
        f"MultiTensorBlocks.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}"
      )
    if self.per_thread > 64:
      raise ValueError(
        f"MultiTensorBlocks: block / (32 num_warps) = {self.per_thread} elements per thread per "
        "array; at most 64 (registers)"
      )

  @property
  def per_thread(self) -> int:
    return max(1, self.block // (32 * self.num_warps))

  @property
  def steps(self) -> int:
    return self.chunk // self.block


def default_blocks(n_inputs: int = 4) -> MultiTensorBlocks:
  """1024-element steps on 4 warps: 8 f32 per thread per array (two 128-bit accesses), so AdamW's
  four input arrays keep 32 loaded values live — a modest ~64 registers, 8 resident programs per SM —
  and 4 steps per program (4096 elements) so the 0.5B tree is ~121K programs, not ~480K."""
  del n_inputs  # one heuristic serves 2-5 input arrays (see kernels.optim.pallas_triton_evidence)
  return MultiTensorBlocks(1024, 4096, 4)


def candidate_blocks(n_inputs: int = 4, n_outputs: int = 3) -> list[MultiTensorBlocks]:
  """The autotuner's grid for the multi-tensor step (heuristic first): steps of 512-4096 elements,
  1 or 4 steps per program, 4 or 8 warps, keeping the estimated registers per thread <= 128 for
  ``n_inputs`` f32 input arrays (``n_outputs`` is accepted for the tuner's symmetry with the bytes)."""
  if not 1 <= n_inputs <= 8 or not 1 <= n_outputs <= 8:
    raise ValueError(f"n_inputs and n_outputs must be in [1, 8], got {n_inputs}, {n_outputs}")
  first = default_blocks(n_inputs)
  out = [first]
  for block in (512, 1024, 2048, 4096):
    for steps in (1, 4):
      for warps in (4, 8):
        b = MultiTensorBlocks(block, block * steps, warps)
        if b != first and estimated_registers(b, n_inputs) <= 128:
          out.append(b)
  return out


def estimated_registers(blocks: MultiTensorBlocks, n_inputs: int) -> int:
  """Registers per thread: the loaded values of every input array live at once (the math reads them
  all before the stores), plus ~32 for addresses, masks, scalars and loop state."""
  return n_inputs * blocks.per_thread + 32
