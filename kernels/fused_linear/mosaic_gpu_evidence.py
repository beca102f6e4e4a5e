"""What the Mosaic GPU fused LM-head kernels should do on an H100, computed rather than measured (no GPU
was available when they were written): programs per launch against the 132 SMs, flops and bytes per
program, shared memory per CTA, the arithmetic intensity of the streamed tiles, and temporary memory.

At the production shape (N = 8192, H = 2048, V = 151936, bf16) with the heuristic's blocks
(128 x 128 logits tiles, 64-column h / w tiles, 3 stages, 6 splits, vocab_chunk 16384):

* stats: 64 row blocks x 6 splits = 384 CTAs (2.9 waves on 132 SMs, 97 % busy; at N = 16384,
  128 x 3); each CTA runs ~198 logits tiles of 2·128·128·2048 = 67 MFLOP and streams (128 + 128) x 2048 x 2 B = 1 MiB of h / w
  per tile through shared memory: 64 flop / byte. At 700 TF/s that is ~11 TB/s from L2 into the
  SMs, more than an H100's L2 is usually measured to deliver (~5.5-7 TB/s): a 1-warpgroup 128 x 128
  tile is L2-bound, so this kernel is not expected near the matmul ceiling (a 2-warpgroup 128 x 256
  tile with cluster multicast, as CUTLASS / Liger do, would quadruple the intensity — not built).
  Rows are the grid's last axis (blockIdx.x, launched fastest), so the ~132 CTAs resident at once
  are two splits' worth of row blocks sweeping the same w tiles: w comes from HBM about once
  (622 MB, ~0.2 ms at 3 TB/s), not once per row block (40 GB), and the 32 MiB of h stays in L2.
  Consecutive wgmmas overlap (one in flight while the next tile's TMA is awaited); no warp
  specialisation, no clusters.
* shared memory: 3 x (128 + 128) x 64 x 2 B = 96 KiB ring + 32 KiB dl tile (dlogits kernel) < 200 KiB.
* flops: 2 N·H·V (stats) + 2 (recompute in the dlogits kernel) + 4 (XLA GEMMs dw = h^T dl and
  dh += dl w^T) = 8 N·H·V. Counting the 6 N·H·V the benchmark credits, 600 TF/s would need 800 TF/s
  of real work, above the 622-798 TF/s bf16 ceiling measured on the H100: the issue's speed target
  is out of reach for any decomposition that never stores logits (Cut Cross-Entropy does 8 as well);
  the chunked path (6 N·H·V, f32 logits chunk in HBM) has the better flop count. The stored
  columns (``MosaicLinearBlocks.stored_cols``) cut the 8 to 7.82-7.92 within the temp target.
* the backward's options (a-f in :func:`backward_options`), at N = 16384 (N = 8192 in brackets),
  TF/s counted on 6 N·H·V, best (798 TF/s, bytes hidden) - worst (622 TF/s, bytes exposed), temp as
  a share of the XLA reference's measured 28488 MiB (14244), against chunked's measured 68.0 ms:
  a  dl chunk + XLA GEMMs (built)       8 N·H·V      598-434 TF/s  1.7 % (3.6 %)  1.33-0.96x
  b  dh H-slices in the dlogits grid   22 N·H·V      218-167 TF/s  1.7 %          0.48-0.37x
  c  on-chip GEMMs, TMA reduce-add      8 N·H·V      257-178 TF/s  4.6 % (8.8 %)  0.57-0.40x
  e  token chunks, stored bf16 exp      6 N·H·V      536-364 TF/s  4.7 % (8.6 %)  1.19-0.81x
     the same, 4096-token chunks        6 N·H·V      734-503 TF/s  8.3 % (16.7 %) 1.63-1.12x
  f  (a) + stored first columns (built) 7.82 N·H·V   609-441 TF/s  5.0 % (5.0 %)  1.35-0.98x
* temporaries: the dl buffer [N, vocab_chunk] bf16 (256 MiB), dh's f32 accumulator [N, H] (64 MiB),
  one chunk's f32 dw GEMM result [H, vocab_chunk] (128 MiB) and its w slice (64 MiB): ~512 MiB, 3.6 %
  of the XLA reference's measured 14244 MiB (1.8 % at N = 16384), against 11 % for ``chunked``.
"""

from __future__ import annotations

import dataclasses

from kernels.fused_linear import mosaic_gpu_blocks as mg


def evidence(n: int, h: int, v: int, blocks: mg.MosaicLinearBlocks | None = None, itemsize=2):
  """The figures above for an [n, h] x [h, v] problem (one vocabulary shard), as a dict."""
  b = mg.default_blocks(n, h, v) if blocks is None else blocks
  bn, bv, bh = b.block_n, b.block_v, b.block_h
  rows, tiles = -(-n // bn), -(-v // bv)
  per_split = -(-tiles // b.splits)
  splits = -(-tiles // per_split)
  vp = tiles * bv
  chunk = min(b.vocab_chunk, vp)
  tile_flops = 2 * bn * bv * h
  tile_bytes = (bn + bv) * h * itemsize
  return dict(
    stats_programs=rows * splits,
    stats_wave_efficiency=mg._waves(rows * splits),
    dlogits_programs_per_chunk=rows * (chunk // bv),
    flops_per_stats_program=tile_flops * per_split,
    bytes_per_stats_program=tile_bytes * per_split,
    tile_intensity=tile_flops / tile_bytes,
    smem_bytes=b.smem_bytes(itemsize),
    ring_bytes=b.stages * (bn + bv) * bh * itemsize,
    flops_total=8 * n * h * v,
    flops_credited=6 * n * h * v,
    temp_bytes=b.temp_bytes(n, h, v, itemsize),
  )


# ------------------------------------------------------------------ the backward's options, modelled
MATMUL_TFS = (622e12, 798e12)  # the H100's measured bf16 matmul ceiling, low and high (2026-11-24)
COPY_BPS = 3.0e12  # its measured copy rate, bytes / s
# measured on that H100 (bench fused_linear, commit 46db0ec): XLA reference temp bytes and the
# chunked path's fwd+bwd time, by token count at H 2048, V 151936, bf16
XLA_REF_TEMP = {8192: 14244.1 * 2**20, 16384: 28488.3 * 2**20}
CHUNKED_S = {8192: 34.789e-3, 16384: 68.031e-3}


def _phases_time(phases) -> tuple[float, float]:
  """(best, worst) seconds of kernels run one after another, each (flops, HBM bytes): best at the
  high matmul ceiling with its bytes hidden under its flops, worst at the low one with none hidden."""
  best = sum(max(f / MATMUL_TFS[1], b / COPY_BPS) for f, b in phases)
  worst = sum(f / MATMUL_TFS[0] + b / COPY_BPS for f, b in phases)
  return best, worst


def backward_options(n: int, h: int, v: int, itemsize: int = 2, *, h_slice: int = 256, tile=128):
  """Each way of forming (loss, dhidden, dlm_head) without [N, V] f32 logits in HBM, as a dict of
  flops, phases (flops, logits-sized HBM bytes), temp bytes and modelled time at the measured
  ceilings, with TF/s counted on 6 N·H·V (the issue's metric). ``a``: built (the dlogits chunk
  plus XLA GEMMs); ``b``: dhidden columns in the dlogits grid (each H-slice recomputes the logits);
  ``c``: dhidden / dlm_head on chip with TMA reduce-add stores per [tile, tile] logits tile;
  ``e``: token chunks storing exp(z - m_tile) in bf16 during the statistics pass (no recompute, but
  an f32 [H, V] dlm_head accumulated once per token chunk), at the largest power-of-two chunk within
  5 % of the XLA reference's temp memory (128 tokens when none fits: ``temp_vs_xla`` then shows the
  overrun; ``e_unbounded``: 4096 tokens, the temp target dropped). XLA reference temp and chunked
  times are the H100 run's, scaled linearly in N between its two token counts."""
  nhv, s = n * h * v, itemsize
  logits = n * v * s  # one [N, V] array in the input dtype
  dw32 = h * v * 4
  xla_temp = XLA_REF_TEMP.get(n, n / 16384 * XLA_REF_TEMP[16384])  # it scales with N
  room = 0.05 * xla_temp - dw32  # what the f32 dlm_head accumulator leaves of the 5 % budget
  e_chunk = 1 << max(int(room // (v * s)).bit_length() - 1, 7) if room >= 128 * v * s else 128
  a_temp = evidence(n, h, v, itemsize=itemsize)["temp_bytes"]

  def stored(nc):
    # stats (writes P~), dl = g (onehot - P~ e^(m - lse)) elementwise, dh GEMM, dw GEMM += per chunk
    return [
      (2 * nhv, logits),
      (0, 2 * logits),
      (2 * nhv, logits),
      (2 * nhv, logits + n // nc * 2 * dw32),
    ]

  # f (built: MosaicLinearBlocks.stored_cols): (a), but the statistics pass also stores exp(z - m)
  # (input dtype) and its row maxes for the first f_cols columns, as many as the temp target leaves
  # (the tuner's largest candidate); their dl is then one elementwise pass, no recomputed tile
  base = mg.default_blocks(n, h, v)
  f_cols = min(base.max_stored_cols(n, h, v, itemsize), v)
  f_temp = dataclasses.replace(base, stored_cols=f_cols).temp_bytes(n, h, v, itemsize)
  f_frac = f_cols / v
  f_phases = [(2 * nhv, f_cols * n * s), (0, 2 * f_cols * n * s)]
  f_phases += [(2 * nhv * (1 - f_frac), (v - f_cols) * n * s), (2 * nhv, logits), (2 * nhv, logits)]
  options = dict(
    a=([(2 * nhv, 0), (2 * nhv, logits), (2 * nhv, logits), (2 * nhv, logits)], a_temp),
    b=([(2 * nhv, 0), ((2 * h // h_slice + 2) * nhv, logits), (2 * nhv, logits)], a_temp),
    c=([(2 * nhv, 0), (6 * nhv, nhv * 4 * 2 // tile)], n * h * 4 + dw32),
    e=(stored(e_chunk), e_chunk * v * s + dw32),
    e_unbounded=(stored(4096), 4096 * v * s + dw32),
    f=(f_phases, f_temp),
  )
  out = {}
  for name, (phases, temp) in options.items():
    best, worst = _phases_time(phases)
    out[name] = dict(
      flops=sum(f for f, _ in phases),
      phases=phases,
      temp_bytes=temp,
      temp_vs_xla=temp / xla_temp,
      time_s=(best, worst),
      counted_tfs=(6 * nhv / best, 6 * nhv / worst),
      vs_chunked=(CHUNKED_S[n] / best, CHUNKED_S[n] / worst) if n in CHUNKED_S else None,
    )
  out["e"]["chunk_tokens"] = e_chunk
  out["f"]["stored_columns"] = f_cols
  return out
