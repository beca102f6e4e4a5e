"""What the multi-tensor launch asks of an H100, computed without one (checked by
tests/kernels/optim/test_optim.py).

For the bench's trees (``bench.shapes.decoder_param_shapes``; f32 params, default
``MultiTensorBlocks(block=1024, chunk=4096, num_warps=4)``), :func:`launch_evidence` gives:

| tree, rule (words) | leaves | params | programs | resident / SM | waves | bytes / program | in flight / SM | ideal at 3.0 TB/s | at 85 % |
|---|---|---|---|---|---|---|---|---|---|
| qwen2.5-0.5b adamw (7) | 290 | 494.0M | 120,717 | 8 | 114.3 | 112 KiB | 128 KiB | 4.61 ms | 5.42 ms |
| qwen2.5-0.5b lion/sgd (5) | 290 | 494.0M | 120,717 | 9 | 101.6 | 80 KiB | 108 KiB | 3.29 ms | 3.87 ms |
| qwen2.5-1.5b adamw (7) | 338 | 1543.7M | 376,989 | 8 | 357.0 | 112 KiB | 128 KiB | 14.41 ms | 16.95 ms |
| qwen2.5-1.5b lion/sgd (5) | 338 | 1543.7M | 376,989 | 9 | 317.3 | 80 KiB | 108 KiB | 10.29 ms | 12.11 ms |

Why that should reach >= 85 % of the ~3.0 TB/s a device-to-device copy reaches (<= 5.5 ms for the 0.5B
AdamW, and >= 2x the 11.6 ms optax measured in the same run):
- Bytes in flight. Little's law: 3.0 TB/s x ~1 us loaded DRAM latency / 132 SMs ~ 23 KB must be in
  flight per SM. A program loads 1024 elements of each input array before its math (8 f32 per
  thread per array: two 128-bit loads — offsets are multiples of the block and the lowering marks
  every pointer 32-byte divisible), ~64 registers per thread, so 8 programs are resident per SM
  (register-bound: 65,536 / (64 x 128)): 8 x 1024 x 16 B = 128 KiB in flight for AdamW, 5.6x the
  need; Lion / SGD (3 inputs, ~56 registers, 9 resident) 108 KiB (4.8x).
- Launches and tails. One launch instead of ~290 (each paying launch latency plus a partial last
  wave: ~290 tails); 114 waves (0.5B AdamW), so the last one idles < 1 % of the machine.
- No extra pass. The operands are the leaves themselves, outputs aliased to them; nothing is
  concatenated. With donated buffers XLA inserts no copy: 7 words move per AdamW parameter. Without
  donation (how the bench compiled the 2026-11-24 run) XLA copies param, mu and nu before the
  aliased kernel, 13 words in all — 13 x 4 B x 494.0M / 17.9 ms = 1.43 TB/s, consistent with that
  run's figure being copy-bound rather than kernel-bound (an inference, not a measurement).
- The reference: XLA's own cost model (:func:`xla_bytes_per_param`, the compiled step on CPU, jax 0.10
  and 0.11 alike, the tiny and cpu-small trees alike) moves 40 B per parameter for optax AdamW and for
  our XLA path (ideal 28: mu and nu are re-read by a second fusion), 28 B for optax Lion (ideal 20)
  and 36 / 24 B for our XLA Lion / SGD-with-momentum paths (ideal 20). The kernel's operands are
  exactly the ideal (AdamW 16 B in, 12 B out); HLO cost analysis cannot see inside the lowered Triton
  call (on the 0.5B tree it reports 56 B per parameter: the free reshapes around the call, counted
  as copies).
None of this is measured on a GPU: the bench (``bench/kernels/cases/optim.py``) is the test of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kernels.optim.pallas_blocks import MultiTensorBlocks, default_blocks, estimated_registers
from kernels.optim.pallas_triton import CTAS_PER_SM, REGS_PER_SM, THREADS_PER_SM, program_starts

H100_SMS = 132
COPY_BANDWIDTH = 3.0e12  # bytes / s, a device-to-device copy on the H100 (2026-11-24 run)
LOADED_LATENCY_S = 1.0e-6  # DRAM latency under load, a conservative round figure


@dataclasses.dataclass(frozen=True)
class LaunchEvidence:
  leaves: int
  params: int
  programs: int  # Σ ceil(leaf size / chunk)
  resident_per_sm: int  # programs an SM holds at once (registers, threads, program slots)
  waves: float  # programs / (SMs x resident)
  bytes_per_program: int  # a full chunk: chunk x words x bytes
  registers_per_thread: int  # the estimate behind resident_per_sm
  bytes_in_flight_per_sm: int  # resident programs x one step's loads
  needed_in_flight_per_sm: int  # Little's law at the copy bandwidth
  ideal_bytes: int  # params x words x bytes: what must move
  ideal_s: float  # ideal_bytes at the copy bandwidth
  target_s: float  # at 85 % of it


def launch_evidence(
  sizes: Sequence[int],  # elements of each leaf
  n_inputs: int,  # arrays read per element (AdamW: p, g, mu, nu = 4)
  n_outputs: int,  # arrays written per element (AdamW: p, mu, nu = 3)
  blocks: MultiTensorBlocks | None = None,
  *,
  word_bytes: int = 4,
  sms: int = H100_SMS,
  bandwidth: float = COPY_BANDWIDTH,
  latency_s: float = LOADED_LATENCY_S,
) -> LaunchEvidence:
  """Programs, occupancy and bytes of one multi-tensor launch over leaves of ``sizes``."""
  if any(n < 0 for n in sizes) or n_inputs < 1 or n_outputs < 1:
    raise ValueError(
      f"sizes must be >= 0 and n_inputs, n_outputs >= 1, got {n_inputs}, {n_outputs}"
    )
  blocks = blocks or default_blocks(n_inputs)
  live = [n for n in sizes if n]
  programs = program_starts(live, blocks.chunk)[-1]
  threads = 32 * blocks.num_warps
  regs = estimated_registers(blocks, n_inputs)
  regs_alloc = -(-regs // 8) * 8  # allocated in units of 8 per thread
  resident = min(CTAS_PER_SM, THREADS_PER_SM // threads, REGS_PER_SM // (regs_alloc * threads))
  words = n_inputs + n_outputs
  params = sum(live)
  ideal = params * words * word_bytes
  return LaunchEvidence(
    leaves=len(sizes),
    params=params,
    programs=programs,
    resident_per_sm=resident,
    waves=programs / (sms * resident),
    bytes_per_program=blocks.chunk * words * word_bytes,
    registers_per_thread=regs,
    bytes_in_flight_per_sm=resident * blocks.block * n_inputs * word_bytes,
    needed_in_flight_per_sm=math.ceil(bandwidth * latency_s / sms),
    ideal_bytes=ideal,
    ideal_s=ideal / bandwidth,
    target_s=ideal / (0.85 * bandwidth),
  )


def table_row(tree: str, rule: str, words: int, e: LaunchEvidence) -> str:
  """One row of the module docstring's table (the test regenerates the table from this)."""
  kib = lambda b: f"{b / 1024:g} KiB"
  return (
    f"| {tree} {rule} ({words}) | {e.leaves} | {e.params / 1e6:.1f}M | {e.programs:,} | "
    f"{e.resident_per_sm} | {e.waves:.1f} | {kib(e.bytes_per_program)} | "
    f"{kib(e.bytes_in_flight_per_sm)} | {e.ideal_s * 1e3:.2f} ms | {e.target_s * 1e3:.2f} ms |"
  )


def xla_bytes_per_param(fn, args, n_params: int, donate_argnums=()) -> float:
  """XLA's cost-analysis bytes of ``fn(*args)`` compiled for the host, per parameter (args may be
  abstract ``jax.ShapeDtypeStruct`` trees: nothing is allocated)."""
  import jax

  compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["bytes accessed"]) / n_params
