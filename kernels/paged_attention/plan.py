"""Launch arithmetic for the GPU paged-decode kernels: the split heuristic and the byte account.

Decode attention is a stream: every cached K / V byte is read once and used for a handful of flops,
so the kernel's speed is the memory system's. Two things decide how close it gets:

* wave efficiency: programs per launch against the SMs. A launch of 128 programs on 132 SMs is one
  wave at 97 %; 136 programs would be two waves, the second nearly empty (52 %). Splitting the page
  list (split-K) multiplies the programs, so the split count is chosen by wave efficiency as
  FlashAttention-2 does (``num_splits_heuristic`` in its ``flash_api.cpp``): no split once the programs
  already fill ~80 % of the SMs, otherwise the fewest splits whose efficiency is within 85 % of the best.
* bytes in flight per SM: by Little's law an SM must keep bandwidth x latency / SMs bytes requested
  (~3.0 TB/s x ~1 us / 132 = ~23 KB; ~32-64 KB with headroom) or the memory system idles between its
  requests. A program keeps ``stages - 1`` blocks of K / V in flight while it computes on one.

Every figure in the kernels' docstrings comes from :func:`launch_plan` (a test re-derives them).
"""

from __future__ import annotations

import dataclasses
import math

H100_SMS = 132
COPY_BANDWIDTH = (
  3.0e12  # B/s: what a device-to-device copy reaches on an H100 SXM (the anchor)
)
MEMORY_LATENCY = 1.0e-6  # s: a loaded HBM access on Hopper, the Little's-law latency
SMEM_PER_SM = 228 * 1024  # an H100 SM's shared memory (227 KB at most for one CTA)
FULL_WAVE = 0.8  # FlashAttention-2: no split once programs >= 0.8 x SMs
NEAR_BEST = 0.85  # ... else the fewest splits within 85 % of the best wave efficiency
MAX_SPLITS = 128


def wave_efficiency(programs: int, sms: int = H100_SMS) -> float:
  """Busy fraction of the SM-waves a launch of ``programs`` equal programs occupies."""
  waves = programs / sms
  return waves / math.ceil(waves)


def wave_splits(work: int, blocks_total: int, sms: int = H100_SMS) -> int:
  """Split-K count for ``work`` (batch x kv heads) programs, each over ``blocks_total`` blocks.

  FlashAttention-2's rule: 1 when work >= 0.8 x sms; else, over the split counts that change the
  blocks per split (more splits with the same ceil(blocks / splits) only add empty programs), the
  fewest whose wave efficiency is >= 85 % of the best.
  """
  if work >= FULL_WAVE * sms or blocks_total <= 1:
    return 1
  limit = min(MAX_SPLITS, sms, blocks_total)
  eligible = [
    s for s in range(1, limit + 1) if s == 1 or -(-blocks_total // s) != -(-blocks_total // (s - 1))
  ]
  best = max(wave_efficiency(work * s, sms) for s in eligible)
  return next(s for s in eligible if wave_efficiency(work * s, sms) >= NEAR_BEST * best)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
  """One launch's account at a problem shape (bytes are K + V page bytes unless named otherwise).

  programs: CTAs per launch (batch x kv heads x splits); waves over ``sms``; wave_efficiency.
  block_bytes: K + V bytes of one pipeline stage (pages_per_block pages of both).
  in_flight_per_cta: (stages - 1) x block_bytes, requested while one block is computed on.
  resident_ctas: CTAs per SM: min(shared-memory limit, programs spread over the SMs).
  in_flight_per_sm: in_flight_per_cta x resident_ctas, against ``little_bytes`` (bandwidth x latency
    per SM). smem_per_cta: the kernel's shared memory (Triton: its pipeline buffers, an estimate).
  max_program_bytes: bytes the busiest program moves (its blocks rounded up to whole blocks).
  ideal_bytes: what the op must read (every token below its length, K and V, once); moved_bytes: what
    the launch reads (whole blocks). ideal_us: ideal_bytes at COPY_BANDWIDTH. bound_us: the busiest
    program's bytes, times the programs each SM runs, at an equal share of COPY_BANDWIDTH per busy SM
    (the launch cannot end before its busiest SM).
  """

  programs: int
  sms: int
  wave_efficiency: float
  block_bytes: int
  stages: int
  in_flight_per_cta: int
  smem_per_cta: int
  resident_ctas: int
  in_flight_per_sm: int
  little_bytes: int
  max_program_bytes: int
  ideal_bytes: int
  moved_bytes: int
  ideal_us: float
  bound_us: float

  def summary(self) -> str:
    """One line for a docstring (the test compares the docstring against it)."""
    kib = lambda x: f"{x / 1024:.0f} KiB"
    return (
      f"{self.programs} programs on {self.sms} SMs ({self.wave_efficiency:.0%} of a wave), "
      f"block {kib(self.block_bytes)} x {self.stages} stages, in flight {kib(self.in_flight_per_sm)}"
      f"/SM (Little: {kib(self.little_bytes)}), smem {kib(self.smem_per_cta)}/CTA, "
      f"busiest program {self.max_program_bytes / 2**20:.2f} MiB, ideal "
      f"{self.ideal_bytes / 1e6:.1f} MB = {self.ideal_us:.0f} us at 3.0 TB/s, tail bound "
      f"{self.bound_us:.0f} us"
    )


def launch_plan(
  *,
  batch: int,
  kv_heads: int,
  head_dim: int,
  page_size: int,
  pages_per_split: int,
  lengths,  # [B] ints: tokens each sequence attends to
  itemsize: int,
  pages_per_block: int,
  num_splits: int,
  stages: int,
  smem_per_cta: int,
  sms: int = H100_SMS,
) -> LaunchPlan:
  """The account of a launch with these blocks (see :class:`LaunchPlan`)."""
  bk = pages_per_block * page_size
  token_bytes = 2 * head_dim * itemsize  # one token's K and V row
  split_tokens = pages_per_split * page_size
  programs = batch * kv_heads * num_splits
  moved, busiest = 0, 0
  for length in lengths:
    for s in range(num_splits):
      tokens = min(max(length - s * split_tokens, 0), split_tokens)
      blocks_bytes = -(-tokens // bk) * bk * token_bytes
      moved += blocks_bytes * kv_heads
      busiest = max(busiest, blocks_bytes)
  ideal = sum(lengths) * token_bytes * kv_heads
  in_flight = (stages - 1) * bk * token_bytes
  resident = max(1, min(SMEM_PER_SM // max(smem_per_cta, 1), -(-programs // sms)))
  busy_sms = min(programs, sms)
  return LaunchPlan(
    programs=programs,
    sms=sms,
    wave_efficiency=wave_efficiency(programs, sms),
    block_bytes=bk * token_bytes,
    stages=stages,
    in_flight_per_cta=in_flight,
    smem_per_cta=smem_per_cta,
    resident_ctas=resident,
    in_flight_per_sm=in_flight * resident,
    little_bytes=int(COPY_BANDWIDTH * MEMORY_LATENCY / sms),
    max_program_bytes=busiest,
    ideal_bytes=ideal,
    moved_bytes=moved,
    ideal_us=ideal / COPY_BANDWIDTH * 1e6,
    bound_us=-(-programs // sms) * busiest / (COPY_BANDWIDTH / busy_sms) * 1e6,
  )
