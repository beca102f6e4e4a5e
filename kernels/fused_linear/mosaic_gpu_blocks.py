"""Tiles of the Mosaic GPU fused LM-head kernels (:mod:`kernels.fused_linear.mosaic_gpu`): the
validated dataclass, the heuristic and the autotuner's grid, with the H100 budgets they respect."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

SMEM_BUDGET = 200 * 1024  # bytes of the H100's 227 KiB of shared memory a CTA may use
NUM_SMS = 132  # H100 SXM
DL_CHUNK_BYTES = 256 << 20  # the dlogits chunk buffer's budget
# The temp target, 5 % of the XLA reference's, in bytes per logit: that reference measured
# 12.0 bytes per [N, V] element on the H100 (14244 MiB at N 8192, 28488 MiB at 16384; V 151936).
TEMP_PER_LOGIT = 0.05 * 12.0
DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MosaicLinearBlocks:
  """Tiles of the Mosaic GPU fused LM-head kernels.

  block_n: token rows per CTA, a multiple of 64 (the wgmma M tile), at most 128 (the f32 logits
    tile lives in one warpgroup's registers: block_n * block_v / 128 registers per thread).
  block_v: vocabulary columns per logits tile, a multiple of 64 (128 bytes of bf16: the swizzle),
    at most 256 (the wgmma N extent); block_n * block_v <= 128 * 128.
  block_h: hidden columns per pipelined h / w tile (the wgmma K chunk), a multiple of 64; divides H.
  stages: depth of the TMA ring, at least 2 (one slot's release is delayed a step so that
    consecutive wgmmas overlap).
  splits: vocabulary ranges of the statistics kernel (grid (N / block_n, splits)).
  vocab_chunk: vocabulary columns per backward chunk (a multiple of block_v): the dlogits buffer is
    [N, vocab_chunk].
  stored_cols: on the training path, the statistics kernel also stores exp(z - m) (input dtype) and
    the running row max m of its tiles of the first ``stored_cols`` vocabulary columns (a multiple
    of block_v; 0: none), so their dl is an elementwise pass instead of a recomputed logits tile:
    2 * stored_cols / V of 2 N·H·V flops saved for [N, stored_cols] more temp memory.
  """

  block_n: int = 128
  block_v: int = 128
  block_h: int = 64
  stages: int = 3
  splits: int = 1
  vocab_chunk: int = 8192
  stored_cols: int = 0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      low = 0 if f.name == "stored_cols" else 1
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        kind = "a non-negative" if low == 0 else "a positive"
        raise ValueError(f"MosaicLinearBlocks.{f.name} must be {kind} int, got {value!r}")
    for name, hi in (("block_n", 128), ("block_v", 256), ("block_h", None)):
      value = getattr(self, name)
      if value % 64 or (hi is not None and value > hi):
        top = f" and at most {hi}" if hi else ""
        raise ValueError(f"MosaicLinearBlocks.{name} must be a multiple of 64{top}, got {value}")
    if self.block_n * self.block_v > 128 * 128:
      raise ValueError(
        f"MosaicLinearBlocks: block_n * block_v must be <= {128 * 128} (one warpgroup's f32 "
        f"registers), got {self.block_n} * {self.block_v}"
      )
    if self.stages < 2:
      raise ValueError(f"MosaicLinearBlocks.stages must be >= 2, got {self.stages}")
    for name in ("vocab_chunk", "stored_cols"):
      if getattr(self, name) % self.block_v:
        raise ValueError(
          f"MosaicLinearBlocks.{name}={getattr(self, name)} must be a multiple of "
          f"block_v={self.block_v}"
        )

  def smem_bytes(self, itemsize: int = 2) -> int:
    """Shared memory of the larger kernel: the h / w ring, the dl (dlogits) or exp(z - m) (storing
    statistics) output tile, row data."""
    ring = self.stages * (self.block_n + self.block_v) * self.block_h * itemsize
    return ring + self.block_n * self.block_v * itemsize + 5 * 4 * self.block_n

  def temp_bytes(self, n: int, h: int, v: int, itemsize: int = 2) -> int:
    """HBM temporaries of the backward: the dl chunk buffer [Np, chunk] (input dtype), dhidden's f32
    accumulator [Np, H], one chunk's f32 dlm_head GEMM result [H, chunk] and its w slice; the stored
    exp(z - m) [Np, stored_cols] (input dtype) with its row maxes, and their dl of the same size."""
    np_ = -(-n // self.block_n) * self.block_n
    vp = -(-v // self.block_v) * self.block_v
    chunk, stored = min(self.vocab_chunk, vp), min(self.stored_cols, vp)
    extra = 2 * np_ * stored * itemsize + np_ * (stored // self.block_v) * 4
    wide = max(chunk, stored)  # the widest GEMM's dlm_head result and w slice
    return np_ * chunk * itemsize + np_ * h * 4 + h * wide * (4 + itemsize) + extra

  def max_stored_cols(self, n: int, h: int, v: int, itemsize: int = 2) -> int:
    """The most stored columns (a block_v multiple, at most V rounded up) within the temp target."""
    budget = TEMP_PER_LOGIT * n * v
    lo, hi = 0, -(-v // self.block_v)
    while lo < hi:  # temp grows with the stored tiles: the largest count under the budget
      mid = (lo + hi + 1) // 2
      blocks = dataclasses.replace(self, stored_cols=mid * self.block_v)
      lo, hi = (mid, hi) if blocks.temp_bytes(n, h, v, itemsize) <= budget else (lo, mid - 1)
    return lo * self.block_v

  def check(self, h: int, dtype) -> None:
    """Raise ValueError unless legal for hidden size ``h`` and ``dtype``."""
    if jnp.dtype(dtype).name not in DTYPES:
      raise ValueError(
        f"impl='mosaic_gpu' needs bfloat16 / float16 hidden and lm_head (wgmma on f32 is tf32), "
        f"got {jnp.dtype(dtype).name}; use impl='chunked'"
      )
    if h % self.block_h:
      raise ValueError(f"MosaicLinearBlocks.block_h={self.block_h} must divide H={h}")
    smem = self.smem_bytes(jnp.dtype(dtype).itemsize)
    if smem > SMEM_BUDGET:
      raise ValueError(
        f"MosaicLinearBlocks use {smem} bytes of shared memory (stages={self.stages}); at most "
        f"{SMEM_BUDGET}"
      )


def _waves(programs: int, sms: int = NUM_SMS) -> float:
  """Fraction of SM-slots busy when ``programs`` CTAs (one per SM at a time) run in waves."""
  return programs / (-(-programs // sms) * sms)


def default_blocks(n: int, h: int, v: int) -> MosaicLinearBlocks:
  """128 x 128 logits tiles (64 rows when N is small), 64-column h / w tiles (128 bytes: the
  swizzle), a 3-deep ring (96 KiB) plus the 32 KiB dl tile; splits (1-16) chosen for the best wave
  efficiency on 132 SMs with at least ~2 waves; the largest vocab_chunk whose bf16 [N, chunk]
  dlogits buffer stays under 256 MiB. Not tuned on hardware (none was available)."""
  bn = 128 if n > 64 else 64
  bv = 128
  bh = next((b for b in (64, 128, 192, 256) if h % b == 0), 64)
  rows, tiles = -(-n // bn), -(-v // bv)
  best = max(
    range(1, min(16, tiles) + 1),
    key=lambda s: (min(rows * s, 2 * NUM_SMS) >= min(2 * NUM_SMS, rows * tiles), _waves(rows * s)),
  )
  np_ = rows * bn
  chunk = max(bv, min(tiles * bv, (DL_CHUNK_BYTES // (np_ * 2)) // bv * bv))
  return MosaicLinearBlocks(bn, bv, bh, 3, best, chunk)


def candidate_blocks(shape, platform: str = "gpu") -> list[MosaicLinearBlocks]:
  """Legal blocks for the autotuner, the heuristic first.

  shape: tokens N, hidden H, vocab V (one shard) and dtype, as attributes (bench.shapes.
  LinearLossShape) or mapping keys (an autotune Problem's ``shape`` dict). platform: "gpu" gives the
  grid below; "cpu" (the interpreter) only the heuristic, to exercise the plumbing; anything else,
  or a dtype other than bf16 / f16, none."""
  get = shape.get if isinstance(shape, dict) else lambda k: getattr(shape, k)
  n, h, v = get("tokens"), get("hidden"), get("vocab")
  if platform not in ("gpu", "cpu") or jnp.dtype(get("dtype")).name not in DTYPES:
    return []
  if platform == "cpu":
    return [default_blocks(n, h, v)]
  base = default_blocks(n, h, v)
  out = [base]
  # vocab_chunk: larger chunks make larger (more efficient) GEMMs for the same flops, at the cost of
  # a larger dl buffer; only those within the temp target (TEMP_PER_LOGIT of N x V)
  for chunk in (base.vocab_chunk // 2, base.vocab_chunk * 2, base.vocab_chunk * 4):
    blocks = dataclasses.replace(base, vocab_chunk=max(base.block_v, chunk))
    if blocks not in out and blocks.temp_bytes(n, h, v) <= TEMP_PER_LOGIT * n * v:
      out.append(blocks)
  # the statistics pass storing exp(z - m) for the first columns: all the temp target allows, half
  most = base.max_stored_cols(n, h, v)
  for cols in (most, most // 2 // base.block_v * base.block_v):
    blocks = dataclasses.replace(base, stored_cols=cols)
    if cols and blocks not in out:
      out.append(blocks)
  for bn, bv, bh, stages in (
    (128, 128, 64, 4),
    (128, 128, 128, 2),
    (64, 256, 64, 3),
    (64, 128, 64, 4),
    (128, 64, 64, 4),
  ):
    for splits in sorted({base.splits, max(1, base.splits // 2), base.splits * 2}):
      chunk = max(bv, base.vocab_chunk // bv * bv)
      try:
        blocks = MosaicLinearBlocks(bn, bv, bh, stages, splits, chunk)
        blocks.check(h, jnp.bfloat16)
      except ValueError:
        continue
      if blocks not in out:
        out.append(blocks)
  return out
