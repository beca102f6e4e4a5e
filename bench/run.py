"""Run one case: compile kernel and reference, check parity on the case's own inputs, time both."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from bench import harness, roofline
from bench.cases import Case
from bench.tolerances import parity_error


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


def _impl(fn, args, case: Case, side: str, peaks, warmup, repeats) -> tuple[ImplResult, object]:
  compiled, compile_s = harness.compile_fn(fn, args)
  outputs = jax.block_until_ready(compiled(*args))
  with jax.profiler.TraceAnnotation(
    f"bench/{case.name}/{side}"
  ):  # names the span in a --profile trace
    timing = harness.time_compiled(
      compiled, args, warmup=warmup, repeats=repeats, compile_s=compile_s
    )
  frac = roofline.roofline_fraction(timing.median_s, case.bytes, case.flops, peaks)
  bps = case.bytes / timing.median_s if case.bytes else None
  fps = case.flops / timing.median_s if case.flops else None
  return ImplResult(timing, harness.memory_of(compiled), frac, bps, fps), outputs


def run_case(
  case: Case, peaks: roofline.DevicePeaks, *, seed: int = 0, warmup: int = 2, repeats: int = 10
) -> CaseResult:
  """Parity first: a kernel that disagrees with the reference is marked failed, however fast."""
  base = dict(
    name=case.name,
    op=case.op,
    shape=case.shape_name,
    mode=case.mode,
    params=case.params,
    bytes=case.bytes,
    flops=case.flops,
  )
  try:
    args = case.make_inputs(seed)
    kernel, k_out = _impl(case.kernel, args, case, "kernel", peaks, warmup, repeats)
    reference, r_out = _impl(case.reference, args, case, "reference", peaks, warmup, repeats)
  except Exception as e:  # a broken case is reported as a failed row, not a crashed run
    return CaseResult(
      **base,
      kernel=None,
      reference=None,
      parity={},
      ok=False,
      speedup=None,
      error=f"{type(e).__name__}: {e}",
    )
  k_flat, r_flat = jax.tree.leaves(k_out), jax.tree.leaves(r_out)
  parity = {
    c.label: max(
      parity_error(
        np.asarray(k_flat[i]), np.asarray(r_flat[i]), c.quantity, c.dtype, c.reduction_len
      )
      for i in _indices(c.index)
    )
    for c in case.checks
  }
  ok = all(err <= 1.0 for err in parity.values())
  return CaseResult(
    **base,
    kernel=kernel,
    reference=reference,
    parity=parity,
    ok=ok,
    speedup=reference.timing.median_s / kernel.timing.median_s,
  )


def _indices(index):
  return index if isinstance(index, tuple) else (index,)
