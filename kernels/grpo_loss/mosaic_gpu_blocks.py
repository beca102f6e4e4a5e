"""The Mosaic GPU loss kernels' blocks and config: what both kernel families need, the row kernels
(:mod:`kernels.grpo_loss.mosaic_gpu`) and the cluster-split kernels
(:mod:`kernels.grpo_loss.mosaic_gpu_cluster`), which the row module dispatches to. Kept here, with each
family's validated blocks and heuristic, so that neither kernel module imports the other's to get
them (and the tuner reads the blocks back from its JSON through the op's table)."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp

from kernels.backend import Target
from kernels.grpo_loss.pallas_blocks import Hopper

SMEM_BUDGET = 200 * 1024  # bytes of the H100's 227 KiB of shared memory the rings may use


@dataclasses.dataclass(frozen=True)
class MosaicLossBlocks:
  """Tiles of the Mosaic GPU kernels.

  block_n: token rows per CTA, a multiple of 64 (the WGMMA register layout's row tile).
  block_v: vocabulary columns per shared-memory tile; block_v * itemsize a multiple of 128 bytes (the
    swizzle width).
  stages: depth of the TMA ring (tiles in flight); the backward has one input and one output ring.
  """

  block_n: int = 64
  block_v: int = 128
  stages: int = 4

  def __post_init__(self):
    for name in ("block_n", "block_v", "stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"MosaicLossBlocks.{name} must be a positive int, got {value!r}")

  def check(self, dtype) -> None:
    itemsize = jnp.dtype(dtype).itemsize
    if self.block_n % 64:
      raise ValueError(f"MosaicLossBlocks.block_n must be a multiple of 64, got {self.block_n}")
    if (self.block_v * itemsize) % 128:
      raise ValueError(
        f"MosaicLossBlocks.block_v * itemsize must be a multiple of 128 bytes (the swizzle), got "
        f"block_v={self.block_v} for {jnp.dtype(dtype).name}"
      )
    ring = 2 * self.stages * self.block_n * self.block_v * itemsize  # backward: in + out rings
    if ring > SMEM_BUDGET:
      raise ValueError(
        f"MosaicLossBlocks use {ring} bytes of shared memory (2 rings of {self.stages} x "
        f"{self.block_n} x {self.block_v}); at most {SMEM_BUDGET}"
      )


def default_blocks(dtype) -> MosaicLossBlocks:
  """64 rows x 128 columns, as many stages as fit in half the budget (4 for bf16, 3 for f32).

  Not tuned on hardware (none was available); the autotuner's cache overrides it per device.
  """
  tile = 64 * 128 * jnp.dtype(dtype).itemsize
  return MosaicLossBlocks(64, 128, max(2, min(4, SMEM_BUDGET // (2 * tile))))


# ------------------------------------------------------------------------- cluster-split kernels
MAX_CLUSTER = 8  # the portable cluster size (16 needs a non-portable launch attribute)
# f32 columns of a row's records (in: id and the coefficient's token inputs; out: lse, log p,
# entropy): 128 bytes, because a Mosaic GPU bulk copy moves a multiple of 128 bytes (one per thread).
RECORD = 32
LANES = 128  # one f32 per thread: the partials record exchanged between CTAs, 4 per row


@dataclasses.dataclass(frozen=True)
class ClusterLossBlocks:
  """Shape of the cluster-split kernels.

  rows: token rows per cluster, 1..32 (each CTA holds its slice of every one in shared memory;
    their 4 partials each fill one 128-lane record).
  cluster: CTAs per cluster, 1..8; each takes 1/cluster of the vocabulary.
  chunk: columns per register vector of the in-shared-memory sweeps; a multiple of
    128 threads x 16 bytes (1024 bf16, 512 f32 columns).
  """

  rows: int = 4
  cluster: int = 8
  chunk: int = 2048

  def __post_init__(self):
    for name in ("rows", "cluster", "chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ClusterLossBlocks.{name} must be a positive int, got {value!r}")
    if self.rows > LANES // 4:
      raise ValueError(f"ClusterLossBlocks.rows must be in [1, {LANES // 4}], got {self.rows}")
    if self.cluster > MAX_CLUSTER:
      raise ValueError(
        f"ClusterLossBlocks.cluster must be in [1, {MAX_CLUSTER}], got {self.cluster}"
      )

  def check(self, dtype, vocab: int) -> None:
    itemsize = jnp.dtype(dtype).itemsize
    unit = 128 * 16 // itemsize
    if self.chunk % unit:
      raise ValueError(
        f"ClusterLossBlocks.chunk must be a multiple of {unit} for {jnp.dtype(dtype).name} "
        f"(128 threads x 16 bytes), got {self.chunk}"
      )
    smem = smem_bytes(self, dtype, vocab)
    if smem > SMEM_BUDGET:
      raise ValueError(
        f"ClusterLossBlocks(rows={self.rows}, cluster={self.cluster}, chunk={self.chunk}) hold "
        f"{smem} bytes of shared memory per CTA at V {vocab}; at most {SMEM_BUDGET}: lower rows or "
        "raise cluster"
      )


def slice_cols(blocks: ClusterLossBlocks, dtype, vocab: int) -> tuple[int, int, int]:
  """(padded V, columns of CTAs 0..C-2, columns of the last CTA), in whole 128-byte units (a bulk
  copy's granularity); V is padded only when it is not a whole number of units or too small to
  leave the last CTA any (V 151936 bf16, C 8: slices of 19008 and 18880 columns, no padding)."""
  unit = 128 // jnp.dtype(dtype).itemsize
  vp = -(-vocab // unit) * unit
  vc = -(-vp // (blocks.cluster * unit)) * unit
  if vp - (blocks.cluster - 1) * vc <= 0:
    vp = blocks.cluster * vc
  return vp, vc, vp - (blocks.cluster - 1) * vc


def smem_bytes(blocks: ClusterLossBlocks, dtype, vocab: int) -> int:
  """Shared memory per CTA: the rows' slices (each rounded up to whole chunks) and small records."""
  _, vc, _ = slice_cols(blocks, dtype, vocab)
  vs = -(-vc // blocks.chunk) * blocks.chunk
  return blocks.rows * vs * jnp.dtype(dtype).itemsize + 2 * blocks.rows * RECORD * 4 + 4 * LANES * 4


def default_cluster_blocks(dtype, vocab: int) -> ClusterLossBlocks:
  """Clusters of 8 (the portable maximum) and the most rows (<= 8) whose CTAs still fit two per SM
  (2 bf16 rows of a 151936 vocabulary: 84 KB per CTA), so that one CTA's bulk loads overlap the
  other's sweeps and stores (a CTA's own phases are serial). Not tuned on hardware; the
  autotuner's candidates (bench/tune.py) decide."""
  chunk = 128 * 16 // jnp.dtype(dtype).itemsize * 2
  for rows in (8, 4, 2, 1):
    blocks = ClusterLossBlocks(rows, MAX_CLUSTER, chunk)
    if 2 * smem_bytes(blocks, dtype, vocab) <= Hopper().smem_per_sm:
      return blocks
  return blocks


def check_vocab(vocab: int) -> None:
  """ids travel as f32 in the row record: exact below 2^24."""
  if vocab >= 2**24:
    raise ValueError(f"ClusterLossBlocks need a vocabulary below 2^24 (ids as f32), got V={vocab}")


# ---------------------------------------------------------------------------- the impl's table row
def candidate_blocks(shape: dict, platform: str) -> list:
  """The tuner's grid at ``shape`` (tokens, vocab, dtype): the row kernels' tile width x ring depth
  (on the CPU interpreter one configuration, the plumbing), and on GPU the cluster-split kernels'
  rows x cluster size; only blocks whose check passes (their rings or slices fit shared memory)."""
  dtype = shape["dtype"]
  itemsize = jnp.dtype(dtype).itemsize
  unit = 128 // itemsize  # swizzle width in elements
  grid = ((unit, 3), (unit, 4), (2 * unit, 2), (2 * unit, 4), (4 * unit, 2))
  if platform == "cpu":
    grid = grid[2:3]  # the interpreter is slow: one config exercises the plumbing
  out = [MosaicLossBlocks(64, bv, stages) for bv, stages in grid]
  if platform == "gpu":  # the cluster-split kernels: rows x CTAs per cluster (the row read once)
    chunk = 2 * 128 * 16 // itemsize
    out += [ClusterLossBlocks(r, c, chunk) for r, c in itertools.product((1, 2, 4), (4, 8))]
  return [b for b in out if supported_on(None, shape, b) is None]


def supported_on(target: Target | None, shape: dict, blocks) -> str | None:
  """Why the Mosaic GPU kernels cannot run ``blocks`` (None: the heuristic's) at ``shape`` on
  ``target`` (a TPU; None: any GPU target), or None."""
  if target is not None and target.platform == "tpu":
    return "impl='mosaic_gpu' is a GPU kernel; on TPU use impl='pallas' (Mosaic TPU)"
  dtype, vocab = shape["dtype"], shape["vocab"]
  try:
    if isinstance(blocks, ClusterLossBlocks):
      check_vocab(vocab)
      blocks.check(dtype, vocab)
    else:
      (blocks or default_blocks(dtype)).check(dtype)
  except ValueError as e:
    return str(e)
  return None


@dataclasses.dataclass(frozen=True)
class MosaicLossConfig:
  target: Target
  blocks: MosaicLossBlocks | ClusterLossBlocks  # the row kernels' tiles or the cluster-split shape
  vocab: int  # the real vocabulary; columns at or past it are padding
  temperature: float


def pad_to(x, n, v):
  """x [N(, V)] zero-padded to [n(, v)] (no copy when it already has that shape)."""
  pad = ((0, n - x.shape[0]),) + (((0, v - x.shape[1]),) if x.ndim == 2 else ())
  return x if all(p == (0, 0) for p in pad) else jnp.pad(x, pad)
