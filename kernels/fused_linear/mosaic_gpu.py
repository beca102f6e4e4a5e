"""Mosaic GPU kernels for the fused LM-head loss (``impl="mosaic_gpu"``): Hopper wgmma + TMA.

Two kernels over flat tokens (h [Np, H], w [H, Vp] one vocabulary shard, both padded to tile
multiples by the wrapper; ids [Np] shard-local), each CTA one warpgroup, token rows the fastest
(last) grid axis:

  stats    grid (splits, Np / block_n). A CTA owns block_n rows and one of ``splits`` contiguous
           ranges of vocabulary tiles. For each [block_n, block_v] logits tile it streams h and w
           tiles of block_h hidden columns through a ``stages``-deep TMA ring (``emit_pipeline``)
           into wgmma, accumulating in f32 registers; the tile folds into the rows' online max /
           sum-exp / E[z] / chosen logit and is dropped. The splits' partial statistics are combined
           in XLA exactly as vocabulary shards are (log-sum-exp of log-sum-exps).
  dlogits  grid (vocab_chunk / block_v, Np / block_n) for one chunk of vocabulary columns: the same
           tile recomputed on chip, dl = g * (onehot(id) - exp(z - lse)) from the global lse, written
           (input dtype) by TMA into a [Np, vocab_chunk] buffer. XLA GEMMs then give the chunk's
           final dw[:, chunk] = h^T dl and add dl w_chunk^T to an f32 dh.

Not the TPU kernel's decomposition (dh, dw accumulated in the kernel): its [block_n, H] and
[H, block_v] f32 accumulators (256 KiB-1 MiB at H = 2048) exceed an SM's 256 KiB of registers and
227 KiB of shared memory, and cross-CTA accumulation would need TMA reduce-add stores, which the
Mosaic GPU interpreter cannot run. So logits never reach HBM; their gradient does, a chunk at a time.
Flops: 2 N·H·V (stats) + 2 (recompute) + 4 (GEMMs) = 8 N·H·V, against 6 for ``chunked``, which keeps
f32 logits chunks (figures: :mod:`kernels.fused_linear.mosaic_evidence`). bf16 / f16 only: wgmma on
f32 operands is tf32, which would not meet the f32 tolerance.
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
from kernels.lse import NEG_BIG

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
  """

  block_n: int = 128
  block_v: int = 128
  block_h: int = 64
  stages: int = 3
  splits: int = 1
  vocab_chunk: int = 8192

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MosaicLinearBlocks.{f.name} must be a positive int, got {value!r}")
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
    if self.vocab_chunk % self.block_v:
      raise ValueError(
        f"MosaicLinearBlocks.vocab_chunk={self.vocab_chunk} must be a multiple of "
        f"block_v={self.block_v}"
      )

  def smem_bytes(self, itemsize: int = 2) -> int:
    """Shared memory of the larger (dlogits) kernel: the h / w ring, the dl output tile, row data."""
    ring = self.stages * (self.block_n + self.block_v) * self.block_h * itemsize
    return ring + self.block_n * self.block_v * itemsize + 4 * 4 * self.block_n

  def temp_bytes(self, n: int, h: int, v: int, itemsize: int = 2) -> int:
    """HBM temporaries of the backward: the dl chunk buffer [Np, chunk] (input dtype), dhidden's f32
    accumulator [Np, H], one chunk's f32 dlm_head GEMM result [H, chunk] and its w slice."""
    np_ = -(-n // self.block_n) * self.block_n
    chunk = min(self.vocab_chunk, -(-v // self.block_v) * self.block_v)
    return np_ * chunk * itemsize + np_ * h * 4 + h * chunk * (4 + itemsize)

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


@dataclasses.dataclass(frozen=True)
class MosaicLinearConfig:
  target: Target
  blocks: MosaicLinearBlocks
  vocab: int  # columns of this shard; columns at or past it are padding
  temperature: float


# -------------------------------------------------------------------------------------------- kernels
def _logits_tile(h_rows, w_gmem, col0, acc_ref, cfg: MosaicLinearConfig):
  """acc_ref += h_rows [bn, H] @ w_gmem[:, col0 : col0 + bv], streamed over block_h columns of H
  through the TMA ring; returns the f32 [bn, bv] tile (WGMMA register layout)."""
  plgpu = backend.mosaic_gpu_module()
  bn, bv, bh = cfg.blocks.block_n, cfg.blocks.block_v, cfg.blocks.block_h
  tiles = backend.smem_transforms(w_gmem.dtype, cfg.target)

  def step(_, h_smem, w_smem):
    plgpu.wgmma(acc_ref, h_smem, w_smem)
    # delay_release=1: a slot is refilled one step after its body returns, so only the previous
    # step's wgmma must be done (it has read its slot) and this one overlaps the next TMA wait
    plgpu.wgmma_wait(1)

  plgpu.emit_pipeline(
    step,
    grid=(w_gmem.shape[0] // bh,),
    in_specs=[
      plgpu.BlockSpec((bn, bh), lambda k: (0, k), transforms=tiles, delay_release=1),
      plgpu.BlockSpec((bh, bv), lambda k: (k, 0), transforms=tiles, delay_release=1),
    ],
    max_concurrent_steps=cfg.blocks.stages,
  )(h_rows, w_gmem.at[:, pl.ds(col0, bv)])
  return acc_ref[...]


def _scaled_tile(h_rows, w_gmem, col0, cfg: MosaicLinearConfig):
  """(z [bn, bv] f32 = logits / temperature, col [bn, bv] int32), both in the WGMMA layout."""
  plgpu = backend.mosaic_gpu_module()
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  tile = functools.partial(_logits_tile, h_rows, w_gmem, col0, cfg=cfg)
  z = pl.run_scoped(tile, plgpu.ACC((bn, bv), jnp.float32)) * (1.0 / cfg.temperature)
  iota = lax.broadcasted_iota(jnp.int32, (bn, bv), 1)
  return z, col0 + backend.layout_cast(iota, plgpu.Layout.WGMMA, cfg.target)


def _stats_kernel(h_gmem, w_gmem, ids_gmem, out_gmem, ids_s, out_s, bar, *, cfg, per_split):
  """One (row block, vocabulary split): partial (lse, chosen, found, E[z]) into out_gmem [4, S, Np]."""
  plgpu = backend.mosaic_gpu_module()
  wg = plgpu.Layout.WGMMA
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  r, s = lax.axis_index("rows"), lax.axis_index("split")
  rows = pl.ds(r * bn, bn)
  plgpu.copy_gmem_to_smem(ids_gmem.at[rows], ids_s, bar)
  plgpu.barrier_wait(bar)
  bcast = lambda a: lax.broadcast_in_dim(a, (bn, bv), [0])
  ids = bcast(cast(ids_s[...], wg.reduce(1)))
  first = s * per_split
  count = jnp.minimum(per_split, w_gmem.shape[1] // bv - first)

  def body(t, carry):
    m, l, acc_s, chosen, found = carry  # [bn] each
    z, col = _scaled_tile(h_gmem.at[rows], w_gmem, (first + t) * bv, cfg)
    valid = col < cfg.vocab
    z = jnp.where(valid, z, -jnp.inf)
    m_new = jnp.maximum(m, z.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(z - bcast(m_new))
    # 0 * log 0 = 0 (p underflows, or a -inf padding column), as the Pallas kernels' online update
    pz = jnp.where(p == 0, 0.0, p * jnp.where(valid, z - bcast(m_new), 0.0))
    acc_s = jnp.where(alpha == 0, 0.0, alpha * (acc_s + (m - m_new) * l)) + pz.sum(axis=1)
    l = alpha * l + p.sum(axis=1)
    hit = (col == ids) & valid
    chosen = chosen + jnp.where(hit, z, 0.0).sum(axis=1)
    found = found + hit.astype(jnp.float32).sum(axis=1)
    return m_new, l, acc_s, chosen, found

  row_vec = lambda value: cast(jnp.full((bn,), value, jnp.float32), wg.reduce(1))
  init = (row_vec(NEG_BIG), row_vec(0.0), row_vec(0.0), row_vec(0.0), row_vec(0.0))
  m, l, acc_s, chosen, found = lax.fori_loop(0, count, body, init)
  lse = m + jnp.log(l)
  for k, val in enumerate((lse, chosen, found, m + acc_s / l)):  # E[z]: acc_s sums p * (z - m)
    out_s.at[k][...] = val
  plgpu.commit_smem()
  for k in range(4):
    plgpu.copy_smem_to_gmem(out_s.at[k], out_gmem.at[k, s, rows])
  plgpu.wait_smem_to_gmem(0)


def _dlogits_kernel(
  h_gmem, w_gmem, ids_gmem, lse_gmem, g_gmem, c0_gmem, dl_gmem, row_s, dl_s, bar, *, cfg
):
  """One [bn, bv] tile of dl = g * (onehot(id) - softmax(z)) for columns c0 + [j * bv, (j + 1) bv)."""
  plgpu = backend.mosaic_gpu_module()
  wg = plgpu.Layout.WGMMA
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  r, j = lax.axis_index("rows"), lax.axis_index("cols")
  rows = pl.ds(r * bn, bn)
  ids_s, lse_s, g_s = row_s
  for src, dst in ((ids_gmem, ids_s), (lse_gmem, lse_s), (g_gmem, g_s)):
    plgpu.copy_gmem_to_smem(src.at[rows], dst, bar)
  plgpu.barrier_wait(bar)
  bcast = lambda a: lax.broadcast_in_dim(cast(a, wg.reduce(1)), (bn, bv), [0])
  ids, lse, g = bcast(ids_s[...]), bcast(lse_s[...]), bcast(g_s[...])
  col0 = pl.multiple_of(c0_gmem[0] + j * bv, bv)  # the wrapper's chunk starts are bv multiples
  z, col = _scaled_tile(h_gmem.at[rows], w_gmem, col0, cfg)
  onehot = (col == ids).astype(jnp.float32)
  # g == 0 (masked / padded rows) or a padding column: exactly 0, whatever the logits
  d = jnp.where((g == 0) | (col >= cfg.vocab), 0.0, g * (onehot - jnp.exp(z - lse)))
  dl_s[...] = d.astype(dl_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(dl_s, dl_gmem.at[rows, pl.ds(j * bv, bv)])
  plgpu.wait_smem_to_gmem(0)


def _stats_call(cfg: MosaicLinearConfig, h, w, ids):
  """h [Np, H], w [H, Vp] (tile multiples), ids [Np] int32 -> partials [4, splits, Np] f32."""
  plgpu = backend.mosaic_gpu_module()
  n, bn = h.shape[0], cfg.blocks.block_n
  tiles = w.shape[1] // cfg.blocks.block_v
  per_split = -(-tiles // cfg.blocks.splits)
  splits = -(-tiles // per_split)  # every split owns at least one tile
  return backend.mosaic_gpu_kernel(
    functools.partial(_stats_kernel, cfg=cfg, per_split=per_split),
    target=cfg.target,
    out_type=jax.ShapeDtypeStruct((4, splits, n), jnp.float32),
    scratch_types=(
      plgpu.SMEM((bn,), jnp.int32),
      plgpu.SMEM((4, bn), jnp.float32),
      plgpu.Barrier(num_arrivals=1),
    ),
    # rows last = blockIdx.x, the fastest-varying: the CTAs resident together share w tiles in L2
    grid=(splits, n // bn),
    grid_names=("split", "rows"),
  )(h, w, ids)


def _dlogits_call(cfg: MosaicLinearConfig, h, w, ids, lse, g, c0, width: int):
  """dl [Np, width] (h's dtype) for vocabulary columns [c0, c0 + width); c0 [1] int32 (traced)."""
  plgpu = backend.mosaic_gpu_module()
  n = h.shape[0]
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  return backend.mosaic_gpu_kernel(
    functools.partial(_dlogits_kernel, cfg=cfg),
    target=cfg.target,
    out_type=jax.ShapeDtypeStruct((n, width), h.dtype),
    scratch_types=(
      (
        plgpu.SMEM((bn,), jnp.int32),
        plgpu.SMEM((bn,), jnp.float32),
        plgpu.SMEM((bn,), jnp.float32),
      ),
      plgpu.SMEM((bn, bv), h.dtype, transforms=backend.smem_transforms(h.dtype, cfg.target)),
      plgpu.Barrier(num_arrivals=3),
    ),
    grid=(width // bv, n // bn),  # rows fastest, as in the statistics kernel
    grid_names=("cols", "rows"),
  )(h, w, ids, lse, g, c0)


# ------------------------------------------------------------------------------------------ wrappers
def _padded(cfg: MosaicLinearConfig, h, w, *rows):
  """h, w and per-row arrays zero-padded to tile multiples (a no-op at N = 8192 / 16384, V = 151936
  with 128-wide tiles). Padded rows have id 0 and g = 0; padded columns are masked in the kernels."""
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  pn, pv = -h.shape[0] % bn, -w.shape[1] % bv
  pad = lambda a, p: a if p == 0 else jnp.pad(a, [(0, p)] + [(0, 0)] * (a.ndim - 1))
  w = w if pv == 0 else jnp.pad(w, ((0, 0), (0, pv)))
  return pad(h, pn), w, *(pad(a, pn) for a in rows)


def combine_splits(partials):
  """[4, S, N] partial (lse, chosen, found, E[z]) of disjoint vocabulary ranges -> four [N]."""
  lse_s, chosen_s, found_s, ez_s = partials
  top = lse_s.max(axis=0)
  lse = top + jnp.log(jnp.exp(lse_s - top).sum(axis=0))
  return lse, chosen_s.sum(axis=0), found_s.sum(axis=0), (jnp.exp(lse_s - lse) * ez_s).sum(axis=0)


def stats(cfg: MosaicLinearConfig, h, w, ids):
  """Per-row (lse, chosen z, found, E[z]) of z = (h @ w) / temperature over this shard's columns, as
  :func:`kernels.fused_linear.pallas.stats`. h: [N, H]; w: [H, V]; ids: [N] int32. All f32 [N]."""
  n = h.shape[0]
  hp, wp, idsp = _padded(cfg, h, w, ids.astype(jnp.int32))
  return tuple(a[:n] for a in combine_splits(_stats_call(cfg, hp, wp, idsp)))


def grads(cfg: MosaicLinearConfig, h, w, ids, lse, g, dh_dtype, dw_dtype):
  """(dh [N, H], dw [H, V]) of sum_n g[n] * (z[n, id_n] - lse[n]), z = (h @ w) / temperature, as
  :func:`kernels.fused_linear.pallas.grads` (g [N] f32 includes 1 / temperature).

  Vocabulary chunk by chunk: the dlogits kernel writes dl [Np, chunk] in h's dtype, then
  dw[:, chunk] = h^T dl (stored in dw_dtype) and dh += dl w[:, chunk]^T (f32 accumulator)."""
  n, hd = h.shape
  v = w.shape[1]
  hp, wp, idsp, lsep, gp = _padded(cfg, h, w, ids.astype(jnp.int32), lse, g)
  vp = wp.shape[1]
  chunk = min(cfg.blocks.vocab_chunk, vp)
  full, tail = divmod(vp, chunk)

  def one(c0: jax.Array, width: int, dh):
    dl = _dlogits_call(cfg, hp, wp, idsp, lsep, gp, c0.reshape(1), width)  # [Np, width]
    wc = lax.dynamic_slice_in_dim(wp, c0, width, axis=1)
    dh = dh + jnp.dot(dl, wc.T, preferred_element_type=jnp.float32)
    dwc = jnp.dot(hp.T, dl, preferred_element_type=jnp.float32).astype(dw_dtype)
    return dh, dwc

  def body(c, carry):
    dh, dw = carry
    c0 = (c * chunk).astype(jnp.int32)
    dh, dwc = one(c0, chunk, dh)
    return dh, lax.dynamic_update_slice_in_dim(dw, dwc, c0, axis=1)

  carry = (jnp.zeros(hp.shape, jnp.float32), jnp.zeros((hd, vp), dw_dtype))
  dh, dw = lax.fori_loop(0, full, body, carry)
  if tail:
    dh, dwc = one(jnp.int32(full * chunk), tail, dh)
    dw = lax.dynamic_update_slice_in_dim(dw, dwc, full * chunk, axis=1)
  return dh[:n].astype(dh_dtype), dw[:, :v]


def make_config(target: Target, blocks, n: int, h: int, v: int, dtype, temperature: float):
  """The validated config of one call (ValueError / TypeError before anything compiles)."""
  backend.check_mosaic_gpu_target(target)
  if blocks is None:
    blocks = default_blocks(n, h, v)
  if not isinstance(blocks, MosaicLinearBlocks):
    raise TypeError(f"blocks for impl='mosaic_gpu' must be MosaicLinearBlocks, got {type(blocks)}")
  blocks.check(h, dtype)
  return MosaicLinearConfig(target, blocks, v, temperature)
