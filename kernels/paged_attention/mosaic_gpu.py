"""Mosaic GPU paged decode attention (``impl="mosaic_gpu"``): GQA with split-K, for Hopper.

One CTA (one warpgroup) per (sequence b, kv head h, split s) computes the online softmax of the G query
heads that share kv head h over the split's pages, so each K/V page is read from HBM once per kv head:

* the G query rows are padded to the 64-row wgmma tile once, in the wrapper, and sit in shared memory;
* K and V pages are gathered by TMA bulk copies (one per page, each with its own barrier) into a
  ``stages``-deep ring of [pages_per_block * page_size, D] shared-memory tiles, so the copies of the
  next blocks are in flight while this one is multiplied;
* scores q·kᵀ and p·v are warpgroup MMAs (wgmma) accumulating in f32 registers (p is staged through
  shared memory); the softmax statistics are WGMMA-layout row reductions;
* each split writes its normalised output and log-sum-exp; ``reference.combine_splits`` merges them.

Only the blocks holding tokens below ``lengths[b]`` are copied (the trip count comes from the length);
tokens past the length inside the last block are masked. bf16 / f16 pages only: wgmma on f32 operands is
tf32, which would not meet the f32 tolerance (use impl="pallas" for f32 caches).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend
from kernels.backend import Target
from kernels.paged_attention.pallas import MASK
from kernels.paged_attention.reference import combine_splits

ROWS = 64  # the wgmma M tile: query heads of one kv head are padded to it
SMEM_BUDGET = 200 * 1024
DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MosaicPagedBlocks:
  """pages_per_block: pages gathered into one [pages_per_block * page_size, D] key / value tile (a
  multiple of 64 tokens, at most 256: the wgmma N / K extents). num_splits: split-K partitions.
  stages: depth of the K / V ring."""

  pages_per_block: int
  num_splits: int = 1
  stages: int = 2

  def __post_init__(self):
    for name in ("pages_per_block", "num_splits", "stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"MosaicPagedBlocks.{name} must be a positive int, got {value!r}")

  def check(self, page_size: int, head_dim: int, dtype) -> None:
    bk = self.pages_per_block * page_size
    if bk % 64 or bk > 256:
      raise ValueError(
        f"MosaicPagedBlocks: pages_per_block * page_size must be a multiple of 64 and <= 256, got "
        f"{self.pages_per_block} * {page_size} = {bk}"
      )
    if page_size % 8:
      raise ValueError(f"the Mosaic GPU kernel needs page_size a multiple of 8, got {page_size}")
    itemsize = jnp.dtype(dtype).itemsize
    smem = ((ROWS + 2 * self.stages * bk) * head_dim + ROWS * bk) * itemsize + ROWS * head_dim * 4
    if smem > SMEM_BUDGET:
      raise ValueError(
        f"MosaicPagedBlocks use {smem} bytes of shared memory (stages={self.stages}, tile {bk} x "
        f"{head_dim}); at most {SMEM_BUDGET}"
      )


def default_blocks(
  batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int, head_dim: int, dtype
) -> MosaicPagedBlocks:
  """128-token K/V tiles (64 when a sequence is shorter), split-K until batch x kv heads x splits reaches
  ~2 CTAs per H100 SM (as the Triton heuristic), and as many ring stages (2-4) as fit.
  Not tuned on hardware (none was available); the autotuner's cache overrides it per device."""
  from kernels.paged_attention.blocks import GPU_SM_TARGET

  tokens = 128 if pages_per_seq * page_size > 64 else 64
  ppb = max(1, tokens // page_size)
  while (ppb * page_size) % 64:
    ppb += 1
  blocks_total = -(-pages_per_seq // ppb)
  splits = 1
  while batch * num_kv_heads * splits < GPU_SM_TARGET and splits * 2 <= blocks_total:
    splits *= 2
  for stages in (4, 3, 2):
    blocks = MosaicPagedBlocks(ppb, splits, stages)
    try:
      blocks.check(page_size, head_dim, dtype)
      return blocks
    except ValueError:
      continue
  return MosaicPagedBlocks(ppb, splits, 1)


@dataclasses.dataclass(frozen=True)
class MosaicPagedConfig:
  target: Target
  blocks: MosaicPagedBlocks
  scale: float


def _kernel(
  lengths_gmem,  # [B] int32
  pages_gmem,  # [B, splits, pages_per_split] int32
  q_gmem,  # [B, Hkv, 64, D]
  k_gmem,  # [Hkv, P, page_size, D]
  v_gmem,
  o_gmem,  # [splits, B, Hkv, 64, D] f32
  lse_gmem,  # [splits, B, Hkv, 64] f32
  q_smem,
  k_smem,
  v_smem,
  p_smem,
  o_smem,
  lse_smem,
  q_bar,
  k_bar,
  v_bar,
  *,
  cfg: MosaicPagedConfig,
):
  plgpu = backend.mosaic_gpu_module()
  wg = plgpu.Layout.WGMMA
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
  ppb, stages = cfg.blocks.pages_per_block, cfg.blocks.stages
  page_size, d = k_gmem.shape[2], k_gmem.shape[3]
  bk = ppb * page_size
  pps = pages_gmem.shape[2]
  length = lengths_gmem[b]
  split_start = s * pps * page_size
  trips = jnp.clip(lax.div(jnp.maximum(length - split_start, 0) + bk - 1, bk), 0, pps // ppb)

  def issue(j):  # TMA-gather block j's pages into ring slot j % stages
    slot = lax.rem(j, stages)
    for i in range(ppb):
      page = pages_gmem[b, s, j * ppb + i]
      rows = pl.ds(i * page_size, page_size)
      bar = slot * ppb + i
      plgpu.copy_gmem_to_smem(k_gmem.at[h, page], k_smem.at[slot, rows], k_bar.at[bar])
      plgpu.copy_gmem_to_smem(v_gmem.at[h, page], v_smem.at[slot, rows], v_bar.at[bar])

  plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, q_bar)
  for j in range(stages):
    pl.when(j < trips)(functools.partial(issue, j))
  plgpu.barrier_wait(q_bar)

  def body(j, carry):
    m, l, acc = carry
    slot = lax.rem(j, stages)
    for i in range(ppb):
      plgpu.barrier_wait(k_bar.at[slot * ppb + i])

    def scores(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
      return acc_ref[...]

    if cfg.target.interpret and not backend.INTERPRETER_TRANSPOSED_WGMMA:
      # Interpreter gap (jax 0.10): wgmma with a transposed operand fails there, so it computes the
      # same product from the shared-memory tiles; jax 0.11's interpreter runs the wgmma itself.
      k_tile = k_smem.at[slot][...]
      qk = jnp.dot(q_smem[...], k_tile.T, preferred_element_type=jnp.float32)
    else:
      qk = pl.run_scoped(scores, plgpu.ACC((ROWS, bk), jnp.float32))
    qk = qk * cfg.scale
    pos = split_start + j * bk + cast(lax.broadcasted_iota(jnp.int32, (ROWS, bk), 1), wg)
    qk = jnp.where(pos < length, qk, MASK)
    m_new = jnp.maximum(m, qk.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(qk - lax.broadcast_in_dim(m_new, qk.shape, [0]))
    l = alpha * l + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    for i in range(ppb):
      plgpu.barrier_wait(v_bar.at[slot * ppb + i])

    # p goes through shared memory: wgmma's A operand from registers is another interpreter gap, and
    # the 64 x bk tile is small next to the K / V tiles. commit_smem orders the stores before the wgmma.
    p_smem[...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()

    def pv(acc_ref):  # a fresh accumulator (the interpreter has no run_state to seed one with acc)
      plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
      return acc_ref[...]

    acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32))
    # Both wgmmas have read this slot (their results are in registers): refill it.
    pl.when(j + stages < trips)(lambda: issue(j + stages))
    return m_new, l, acc

  init = (
    cast(jnp.full((ROWS,), MASK, jnp.float32), wg.reduce(1)),
    cast(jnp.zeros((ROWS,), jnp.float32), wg.reduce(1)),
    cast(jnp.zeros((ROWS, d), jnp.float32), wg),
  )
  m, l, acc = lax.fori_loop(0, trips, body, init)
  seen = l > 0  # a split that saw no token: (0, -inf)
  safe_l = jnp.where(seen, l, 1.0)
  o_smem[...] = acc * lax.broadcast_in_dim(1.0 / safe_l, acc.shape, [0])
  lse_smem[...] = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, b, h])
  plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[s, b, h])
  plgpu.wait_smem_to_gmem(0)


def _splits(cfg: MosaicPagedConfig, q, k_pages, v_pages, lengths, page_indices):
  """q [B, Hkv, 64, D]; page_indices [B, splits * k * pages_per_block] -> (o, lse) per split."""
  plgpu = backend.mosaic_gpu_module()
  b, hkv, _, d = q.shape
  page_size = k_pages.shape[2]
  ppb, splits, stages = cfg.blocks.pages_per_block, cfg.blocks.num_splits, cfg.blocks.stages
  bk = ppb * page_size
  dtype = k_pages.dtype
  tiles = backend.smem_transforms(dtype, cfg.target)
  return backend.mosaic_gpu_kernel(
    functools.partial(_kernel, cfg=cfg),
    target=cfg.target,
    out_type=(
      jax.ShapeDtypeStruct((splits, b, hkv, ROWS, d), jnp.float32),
      jax.ShapeDtypeStruct((splits, b, hkv, ROWS), jnp.float32),
    ),
    scratch_types=(
      plgpu.SMEM((ROWS, d), dtype, transforms=tiles),
      plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
      plgpu.SMEM((stages, bk, d), dtype, transforms=tiles),
      plgpu.SMEM((ROWS, bk), dtype, transforms=tiles),
      plgpu.SMEM(
        (ROWS, d), jnp.float32, transforms=backend.smem_transforms(jnp.float32, cfg.target)
      ),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_arrivals=1),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages * ppb),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages * ppb),
    ),
    grid=(b, hkv, splits),
    grid_names=("b", "h", "s"),
  )(lengths, page_indices.reshape(b, splits, -1), q, k_pages, v_pages)


def paged_attention(
  q,  # [B, Hq, D]
  k_pages,  # [Hkv, P, page_size, D]
  v_pages,  # [Hkv, P, page_size, D]
  lengths,  # [B] int32, already clipped to pages_per_seq * page_size
  page_indices,  # [B, pages_per_seq] int32
  *,
  scale: float,
  target: Target,
  blocks: MosaicPagedBlocks | None,
):  # -> [B, Hq, D] in q's dtype
  """The body of ``kernels.paged_attention(..., impl="mosaic_gpu")`` after its validation."""
  backend.check_mosaic_gpu_target(target)
  b, hq, d = q.shape
  hkv, _, page_size, _ = k_pages.shape
  if jnp.dtype(k_pages.dtype).name not in DTYPES:
    raise ValueError(
      f"impl='mosaic_gpu' needs {DTYPES} pages (wgmma on f32 is tf32), got {k_pages.dtype}"
    )
  if d % 64 or d > 256:
    raise ValueError(f"the Mosaic GPU kernel needs head_dim a multiple of 64, <= 256; got {d}")
  g = hq // hkv
  if g > ROWS:
    raise ValueError(
      f"the Mosaic GPU kernel handles at most {ROWS} query heads per kv head, got {g}"
    )
  if blocks is None:
    blocks = default_blocks(b, hkv, page_indices.shape[1], page_size, d, k_pages.dtype)
  if not isinstance(blocks, MosaicPagedBlocks):
    raise TypeError(f"blocks for impl='mosaic_gpu' must be MosaicPagedBlocks, got {type(blocks)}")
  blocks.check(page_size, d, k_pages.dtype)
  return _call(MosaicPagedConfig(target, blocks, scale), q, k_pages, v_pages, lengths, page_indices)


@functools.partial(jax.jit, static_argnums=0)
def _call(cfg: MosaicPagedConfig, q, k_pages, v_pages, lengths, page_indices):
  b, hq, d = q.shape
  hkv = k_pages.shape[0]
  g = hq // hkv
  qg = q.reshape(b, hkv, g, d).astype(k_pages.dtype)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))  # zero rows: sliced off below
  per_step = cfg.blocks.pages_per_block * cfg.blocks.num_splits
  pad = -page_indices.shape[1] % per_step
  page_indices = jnp.pad(page_indices, ((0, 0), (0, pad)))  # filler page 0: beyond every length
  o, lse = _splits(cfg, qg, k_pages, v_pages, lengths.astype(jnp.int32), page_indices)
  out = o[0] if cfg.blocks.num_splits == 1 else combine_splits(o, lse)
  return out[:, :, :g].reshape(b, hq, d).astype(q.dtype)
