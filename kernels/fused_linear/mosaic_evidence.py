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
  the chunked path (6 N·H·V, f32 logits chunk in HBM) has the better flop count.
* temporaries: the dl buffer [N, vocab_chunk] bf16 (256 MiB), dh's f32 accumulator [N, H] (64 MiB),
  one chunk's f32 dw GEMM result [H, vocab_chunk] (128 MiB) and its w slice (64 MiB): ~512 MiB, 3.6 %
  of the XLA reference's measured 14244 MiB (1.8 % at N = 16384), against 11 % for ``chunked``.
"""

from __future__ import annotations

from kernels.fused_linear import mosaic_gpu as mg


def evidence(n: int, h: int, v: int, blocks: mg.MosaicLinearBlocks | None = None, itemsize=2):
  """The figures above for an [n, h] x [h, v] problem (one vocabulary shard), as a dict."""
  b = mg.default_blocks(n, h, v) if blocks is None else blocks
  bn, bv, bh = b.block_n, b.block_v, b.block_h
  rows, tiles = -(-n // bn), -(-v // bv)
  per_split = -(-tiles // b.splits)
  splits = -(-tiles // per_split)
  np_, vp = rows * bn, tiles * bv
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
    temp_bytes=np_ * chunk * itemsize + np_ * h * 4 + h * chunk * 4 + h * chunk * itemsize,
  )
