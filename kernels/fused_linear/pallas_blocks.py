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


def fused_vmem_bytes(blocks: LinearBlocks, rows: int, h: int, itemsize: int, carry: bool) -> int:
  """VMEM of the one-kernel gradients (:mod:`.pallas_tpu_grads`) holding ``rows`` rows of dh: the
  resident f32 [rows, H] dh accumulator, the f32 [H, bv] dw accumulator, double-buffered h / w tiles
  and dw output (f32 in and out when a previous superblock's dw is ``carry``-ed), the f32 dot results
  and ~5 f32 [bn, bv] temporaries, [bn, 1] per-token blocks padded to 128 lanes."""
  bn, bv = blocks.block_n, blocks.block_v
  tile, row = bn * bv * 4, bn * 128 * 4
  dw_io = 2 * h * bv * (4 if carry else itemsize) + (2 * h * bv * 4 if carry else 0)
  return rows * h * 4 + h * bv * 4 + 2 * (bn * h + h * bv) * itemsize + dw_io + (bn * h + h * bv) * 4 + 5 * tile + 6 * row  # fmt: skip


# Fewest rows a one-kernel call holds before the separate dhidden / dweight kernels are cheaper: each
# extra superblock re-reads w and moves the f32 dw in and out of HBM once.
MIN_FUSED_ROWS = 2048


def fused_rows(blocks: LinearBlocks, n: int, h: int, itemsize: int, target: Target) -> int:
  """Rows one call of the one-kernel gradients holds (a multiple of block_n; n when all fit), or 0
  where fewer than min(n, MIN_FUSED_ROWS) fit the target's VMEM (then the two-kernel path runs).
  Also 0 on a megacore chip (v4, v5p: two TensorCores behind one device), where the two-kernel
  path's dweight splits the vocabulary over both cores and this kernel's accumulating grid could
  not, and on a TPU target of unknown generation. Off TPU (the interpreter) all rows."""
  if target.platform != "tpu" or target.interpret:
    return n
  gen = target.tpu
  if gen is None or gen.cores_per_chip > gen.devices_per_chip:
    return 0
  bn = blocks.block_n
  padded = -(-n // bn) * bn
  if fused_vmem_bytes(blocks, padded, h, itemsize, False) <= target.vmem_bytes:
    return n
  fixed = fused_vmem_bytes(blocks, 0, h, itemsize, True)
  rows = (target.vmem_bytes - fixed) // (h * 4) // bn * bn
  return rows if rows >= min(n, MIN_FUSED_ROWS) else 0


# The TPU heuristic's tiles, best first: the first whose kernels fit the generation's VMEM is taken.
TPU_TILES = ((256, 512), (256, 256), (128, 256), (128, 128))
# Where the one-kernel gradients run (one TensorCore per device), best first; the first whose
# kernels fit VMEM *and* whose one-kernel gradients hold min(N, MIN_FUSED_ROWS) rows (:func:`fused_rows`)
# is taken. Compiled at qwen2.5-3b-8k (libtpu 0.0.42.1), each kernel alone, bundles per grid step and
# modelled time:
#   v6e  512 x 1536: statistics 7443 x [16, 100] (6.80 ms; row groups of 8: pallas_tpu.row_group),
#        gradients 4 row superblocks of 2048, 19044-19082 x [99, 4] each (17.25 ms in all).
#        512 x 768: 3847 x [16, 199] (7.00 ms), 9802 x [198, 16] (17.74 ms, one superblock).
#        512 x 512: 2604 x [16, 298] (7.09 ms), 6704 x [297, 16] (18.19 ms).
#   v5e  512 x 1536: 20831 (22.18 ms), 4 superblocks of 63396-63541 (66.9 ms in all); 512 x 768:
#        9654 (20.45 ms), 31174 (65.71 ms); 512 x 512: 7401 (23.48 ms), 22631 (71.55 ms). Its
#        forward schedules under its flop floor (25.9 ms) at each; 512 x 768 would save 3 % of the
#        gradients' 89 ms, a per-generation table's gain, not taken.
#   v7x  512 x 768 / 1536 leave too few dh rows in its 64 MiB for the one kernel (dhidden + dweight:
#        20.7 ms of gradients at 512 x 768, against 8.6 ms over one-kernel superblocks at 512 x 512),
#        and its statistics are slower there (4.33 ms at 512 x 768 against 4.11): 512 x 512.
# Not better for v6e's statistics (16-row groups unless said): 512 x 1792 / 2048 (6.85 / 7.24 ms),
# 1024 x 768 (6.91), 256 x 1536 (6.96), 512 x 1280 (7.00), 512 x 896 (7.67), 512 x 640 (8.04) (these
# at 8-row groups), 512 x 1024 (7.26), 1024 x 512 (7.08), 768 x 512 (7.61), 256 x 1024 (7.85), 256 x
# 512 (7.60), 512 x 384 (8.86), 512 x 256 (8.31); the product issued as smaller
# dots (row / column chunks of 64-256, K whole: fewer spills, more bundles, 7.33-12.1 ms); the ids
# broadcast across lanes once a row group, or passed lane-dense (7.59-7.95 ms). Each step pops 8
# K-passes of the f32 tile from the MXU and spills the partial sums.
ONE_CORE_TPU_TILES = ((512, 1536), (512, 768), (512, 512), *TPU_TILES)


def default_blocks(target: Target, n: int, h: int, v: int, itemsize: int = 2) -> LinearBlocks:
  """The heuristic. Why these numbers (TPU; not yet tuned on hardware, none was available):

  * Where a device is one TensorCore (v5e, v6e, v7x): the first of :data:`ONE_CORE_TPU_TILES`
    (compiled figures there) whose one-kernel gradients hold their rows: 512 x 1536 on v5e / v6e,
    512 x 512 on v7x (64 MiB of VMEM); else 256 x 512: MXU-shaped on every generation (128 / 256
    wide), each weight tile pushed for more rows the bigger block_n.
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
    gen = target.tpu
    one_core = gen is not None and gen.cores_per_chip == gen.devices_per_chip
    first_fit = None  # where no tile's one-kernel gradients hold their rows: the split runs
    for bn, bv in ONE_CORE_TPU_TILES if one_core else TPU_TILES:
      blocks = LinearBlocks(
        block_n=n if n <= bn else bn, block_v=v if v <= bv else bv, block_h=block_h
      )
      if max(kernel_vmem_bytes(blocks, h, itemsize).values()) <= target.vmem_bytes:
        if not one_core or fused_rows(blocks, n, h, itemsize, target) > 0:
          return blocks
        first_fit = first_fit or blocks
    return first_fit or blocks
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
