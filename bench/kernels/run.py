"""Run one case: compile kernel and reference, check parity on the case's own inputs, time both.

Before anything is allocated the case is compiled from abstract inputs and XLA's memory analysis is
compared with what the device can hold: a case that cannot fit is a skipped row with that reason, not an
out-of-memory error. Parity is reduced on the device (:func:`bench.kernels.harness.device_parity`). Every
input, output and executable of a case is released before the next one starts.
"""

from __future__ import annotations

import dataclasses
import gc

import jax

from bench.kernels import harness, roofline
from bench.kernels.cases import Case


@dataclasses.dataclass
class ImplResult:
  timing: harness.Timing
  memory: harness.Memory
  roofline_fraction: float | None
  achieved_bytes_per_s: float | None
  achieved_flops_per_s: float | None = (
    None  # case.flops / median (the op's useful flops, not recomputation)
  )


@dataclasses.dataclass
class CaseResult:
  name: str
  op: str
  shape: str
  mode: str
  params: dict
  bytes: float | None
  flops: float | None
  kernel: ImplResult | None
  reference: ImplResult | None
  parity: dict  # check label -> error as a fraction of its tolerance (<= 1 passes)
  ok: bool
  speedup: float | None  # reference median / kernel median
  error: str | None = None
  skipped: str | None = None  # why the case did not run (it cannot fit the device); ok stays True


def _timed(compiled, args, case: Case, side: str, compile_s, peaks, warmup, repeats, seed):
  fresh = (lambda: case.make_inputs(seed)) if case.donate_argnums else None
  with jax.profiler.TraceAnnotation(f"bench/{case.name}/{side}"):  # names a --profile trace's span
    timing = harness.time_compiled(
      compiled, args, warmup=warmup, repeats=repeats, compile_s=compile_s, fresh_args=fresh
    )
  # the outputs parity compares: from the case's own inputs (fresh ones when the call consumes them)
  outputs = jax.block_until_ready(compiled(*(fresh() if fresh else args)))
  frac = roofline.roofline_fraction(timing.median_s, case.bytes, case.flops, peaks)
  bps = case.bytes / timing.median_s if case.bytes else None
  fps = case.flops / timing.median_s if case.flops else None
  return ImplResult(timing, harness.memory_of(compiled), frac, bps, fps), outputs


def fit_problem(kernel: harness.Memory, reference: harness.Memory, limit: int | None) -> str | None:
  """Why the case cannot fit ``limit`` bytes, or None. The kernel runs first; its outputs stay live
  while the reference runs (parity compares the two), so the need is max(kernel peak, reference
  peak + kernel outputs). Unknown (a backend without memory analysis, no limit): assume it fits."""
  if limit is None or kernel.peak_bytes is None or reference.peak_bytes is None:
    return None
  need = max(kernel.peak_bytes, reference.peak_bytes + harness.output_bytes(kernel))
  if need <= limit:
    return None
  return (
    f"needs {need / 2**30:.2f} GiB by XLA's memory analysis (kernel peak "
    f"{kernel.peak_bytes / 2**30:.2f}, reference peak {reference.peak_bytes / 2**30:.2f} GiB) > "
    f"the device's {limit / 2**30:.2f} GiB"
  )


def run_case(
  case: Case,
  peaks: roofline.DevicePeaks,
  *,
  seed: int = 0,
  warmup: int = 2,
  repeats: int = 10,
  memory_limit: int | None = None,
) -> CaseResult:
  """Parity first: a kernel that disagrees with the reference is marked failed, however fast.

  ``memory_limit``: bytes the case may use (default: the device's ``bytes_limit``; None on CPU).
  """
  base = dict(
    name=case.name,
    op=case.op,
    shape=case.shape_name,
    mode=case.mode,
    params=case.params,
    bytes=case.bytes,
    flops=case.flops,
  )
  none = dict(kernel=None, reference=None, parity={}, speedup=None)
  limit = memory_limit if memory_limit is not None else harness.device_memory_limit()
  why = case.unavailable() if case.unavailable else None
  if why:  # an optional peer that cannot be installed here: skipped with its reason
    return CaseResult(**base, **none, ok=True, skipped=why)
  try:
    result = _measure(case, base, peaks, seed, warmup, repeats, limit)
  except Exception as e:  # a broken case is reported as a failed row, not a crashed run
    result = CaseResult(**base, **none, ok=False, error=f"{type(e).__name__}: {e}")
  release()
  return result


def _measure(case, base, peaks, seed, warmup, repeats, limit) -> CaseResult:
  abstract = jax.eval_shape(lambda: case.make_inputs(seed))  # shapes only: nothing allocated
  k_exe, k_s = harness.compile_fn(case.kernel, abstract, case.donate_argnums)
  r_exe, r_s = harness.compile_fn(case.reference, abstract, case.donate_argnums)
  reason = fit_problem(harness.memory_of(k_exe), harness.memory_of(r_exe), limit)
  if reason:
    none = dict(kernel=None, reference=None, parity={}, speedup=None)
    return CaseResult(**base, **none, ok=True, skipped=reason)
  args = None if case.donate_argnums else case.make_inputs(seed)
  kernel, k_out = _timed(k_exe, args, case, "kernel", k_s, peaks, warmup, repeats, seed)
  reference, r_out = _timed(r_exe, args, case, "reference", r_s, peaks, warmup, repeats, seed)
  parity = harness.device_parity(k_out, r_out, case.checks)
  return CaseResult(
    **base,
    kernel=kernel,
    reference=reference,
    parity=parity,
    ok=all(err <= 1.0 for err in parity.values()),
    speedup=reference.timing.median_s / kernel.timing.median_s,
  )


def release() -> None:
  """Drop what a finished case left behind: compiled executables in jax's caches and any arrays
  only reachable from collected frames (an exception's traceback holds the inputs otherwise)."""
  jax.clear_caches()
  gc.collect()
