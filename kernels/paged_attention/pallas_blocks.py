"""Block sizes for paged decode attention: a validated dataclass and the per-backend heuristic, and the
Pallas kernels' static config (:class:`PagedConfig`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels.backend import Target
from kernels.paged_attention import plan as plan_lib
from kernels.tpu_vmem import scoped_vmem

GPU_TILE_TOKENS = 64  # Triton K / V tile: 4 pages of 16; 32 KiB of bf16 K + V per stage at D = 128
GPU_STAGES = 4  # Triton software-pipeline depth: 3 tiles (96 KiB) requested while one is computed
GPU_WARPS = 4
TPU_BLOCK_TOKENS = 1024  # tokens per TPU block (fewer when many kv heads share a step's VMEM)


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
  """How one (sequence, kv head) walks its pages.

  pages_per_block: pages whose keys form one [pages_per_block * page_size, D] score tile (the page
    ids of a block are read once, as one vector, then its pages are gathered together).
  num_splits: split-K partitions of the page list, run in parallel and merged exactly (log-sum-exp);
    they add programs when batch x kv heads is too small to fill the chip (see :mod:`.plan`).
  num_stages: GPU (Triton) software-pipeline depth of the page loop: the gathers of the next
    ``num_stages - 1`` blocks are in flight while one block is computed. Ignored on TPU / CPU.
  num_warps: GPU (Triton) warps per program. Ignored on TPU / CPU.
  """

  pages_per_block: int
  num_splits: int = 1
  num_stages: int = GPU_STAGES
  num_warps: int = GPU_WARPS

  def __post_init__(self):
    for name in ("pages_per_block", "num_splits", "num_stages", "num_warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"PagedBlocks.{name} must be a positive int, got {value!r}")
    if self.num_warps & (self.num_warps - 1) or self.num_warps > 16:
      raise ValueError(f"PagedBlocks.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
    if self.num_stages > 8:
      raise ValueError(f"PagedBlocks.num_stages must be in [1, 8], got {self.num_stages}")

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

  def plan(
    self,
    *,
    batch: int,
    kv_heads: int,
    q_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    lengths,  # [B] ints
    itemsize: int,
  ) -> plan_lib.LaunchPlan:
    """The Triton launch's account (:func:`.plan.launch_plan`). Shared memory is an estimate: Triton
    allocates it; its pipeline keeps ``num_stages`` K / V tile buffers plus the padded query tile."""
    bk = self.pages_per_block * page_size
    gp = max(16, 1 << (q_heads // kv_heads - 1).bit_length())
    smem = self.num_stages * 2 * bk * head_dim * itemsize + gp * head_dim * itemsize
    return plan_lib.launch_plan(
      batch=batch,
      kv_heads=kv_heads,
      head_dim=head_dim,
      page_size=page_size,
      pages_per_split=-(-pages_per_seq // (self.pages_per_block * self.num_splits))
      * self.pages_per_block,
      lengths=lengths,
      itemsize=itemsize,
      pages_per_block=self.pages_per_block,
      num_splits=self.num_splits,
      stages=self.num_stages,
      smem_per_cta=smem,
    )


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  target: Target
  blocks: PagedBlocks
  scale: float


def tile_vmem_bytes(
  blocks: PagedBlocks, page_size: int, head_dim: int, group: int, itemsize: int, kv_heads: int = 1
):
  """VMEM of one TPU grid step (a model, conservative): the two K and V block slots of every kv head
  (the kernel's DMA buffers), the masked V and its position iota ([bk, D] 32-bit each), the [G, bk]
  f32 scores / probabilities, and per kv head the [G, D] / [G, 128] query, output and scratch tiles."""
  bk = blocks.pages_per_block * page_size
  g = max(group, 8)  # a [G, x] tile occupies at least 8 sublanes
  return 4 * kv_heads * bk * head_dim * itemsize + 2 * bk * head_dim * 4 + 3 * g * bk * 4 + 8 * kv_heads * g * max(head_dim, 128) * 4  # fmt: skip


def legal_on(target: Target, blocks: PagedBlocks, shape: dict) -> str | None:
  """Why ``blocks`` cannot compile for ``target`` at ``shape`` (the tuner's dict: dtype, batch,
  q_heads, kv_heads, head_dim, page_size, ctx), or None: :meth:`PagedBlocks.check`, and on TPU one
  grid step within the scoped VMEM default (the kernel passes no limit)."""
  itemsize = jnp.dtype(shape["dtype"]).itemsize
  try:
    blocks.check(target, shape["page_size"], shape["head_dim"], itemsize)
  except ValueError as e:
    return str(e)
  if target.platform != "tpu" or target.interpret:
    return None
  group = shape["q_heads"] // shape["kv_heads"]
  need = tile_vmem_bytes(
    blocks, shape["page_size"], shape["head_dim"], group, itemsize, shape["kv_heads"]
  )
  if need > scoped_vmem(target):
    return (
      f"TPU {target.generation or '(any generation)'}: a step of {blocks.pages_per_block} pages "
      f"needs ~{need / 2**20:.1f} MiB of VMEM, over the {scoped_vmem(target) / 2**20:.0f} MiB "
      "scoped default (fewer pages_per_block fit)"
    )
  return None


def default_blocks(
  target: Target, batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int
) -> PagedBlocks:
  """The heuristic. Why these numbers (not yet tuned on hardware; none was available):

  * GPU: a 64-token K / V tile (pages_per_block * page_size, at least 16 for the Triton dot) in a
    4-stage pipeline (3 tiles in flight per program: 96 KiB of bf16 at D = 128, above the ~23-64 KiB
    per SM that Little's law asks), 4 warps, and split-K by wave efficiency
    (:func:`.plan.wave_splits`): none once batch x kv heads fills ~80 % of the 132 SMs.
  * TPU: blocks of 1024 tokens (512 from 4 kv heads, 256 from 8: the K / V slots of all kv heads, 2
    MiB at D = 128 in bf16, stay well inside the scoped VMEM), one split: each grid step walks one
    sequence's pages with its page DMAs one block ahead (the next sequence's first block included),
    and the kernel's core axis already spreads the batch over megacore's two TensorCores. Fewer,
    larger blocks amortise each block's loop, waits and softmax bookkeeping; the per-page DMA issue
    (~6 bundles for all kv heads) does not depend on them.
  * CPU interpreter: the whole page list in one step, because each grid step costs interpreter overhead.
  """
  if target.platform == "gpu":
    tile = max(GPU_TILE_TOKENS // page_size, 1)
    ppb = max(1, min(_pow2_floor(tile), _pow2_ceil(pages_per_seq)))
    while ppb * page_size < 16:
      ppb *= 2
    splits = plan_lib.wave_splits(batch * num_kv_heads, -(-pages_per_seq // ppb))
    return PagedBlocks(ppb, splits)
  if target.platform == "tpu" and not target.interpret:
    tokens = max(128, min(TPU_BLOCK_TOKENS, 2048 // num_kv_heads))
    return PagedBlocks(max(1, min(tokens // page_size, pages_per_seq)), 1)
  return PagedBlocks(max(1, min(pages_per_seq, 64)), 1)


def _pow2_floor(x: int) -> int:
  return 1 << (x.bit_length() - 1)


def _pow2_ceil(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()
