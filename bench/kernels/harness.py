"""Compile once, warm up, time the median of repeats with ``block_until_ready``; memory from XLA."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
  "Memory",
  "Timing",
  "compile_fn",
  "device_memory_limit",
  "device_parity",
  "memory_of",
  "output_bytes",
  "time_compiled",
]


@dataclasses.dataclass(frozen=True)
class Timing:
  """A timed executable's repeats: median, min, max and interquartile range (seconds), the repeat
  count and the compile time."""

  median_s: float
  min_s: float
  max_s: float
  iqr_s: float  # interquartile range: the spread reported beside the median
  repeats: int
  compile_s: float
  q1_s: float | None = None  # first and third quartiles (the IQR's ends; None in older reports)
  q3_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Memory:
  """From the compiled executable's memory analysis (bytes; None where the backend reports none)."""

  temp_bytes: int | None
  argument_bytes: int | None
  output_bytes: int | None
  alias_bytes: int | None

  @property
  def peak_bytes(self) -> int | None:
    parts = (self.temp_bytes, self.argument_bytes, self.output_bytes)
    if any(p is None for p in parts):
      return None
    return sum(parts) - (self.alias_bytes or 0)


def compile_fn(fn: Callable, args: tuple, donate_argnums=()) -> tuple[Any, float]:
  """AOT-compile ``fn`` for ``args``; returns (compiled, seconds spent lowering + compiling)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def memory_of(compiled) -> Memory:
  """XLA's memory analysis of a compiled executable (temp, argument, output, alias bytes); None
  fields where the backend does not implement it."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # some backends do not implement it
    m = None
  get = lambda name: None if m is None else getattr(m, name, None)
  return Memory(
    get("temp_size_in_bytes"),
    get("argument_size_in_bytes"),
    get("output_size_in_bytes"),
    get("alias_size_in_bytes"),
  )


def time_compiled(
  compiled,
  args: tuple,
  *,
  warmup: int = 2,
  repeats: int = 10,
  compile_s: float = 0.0,
  fresh_args: Callable[[], tuple] | None = None,
) -> Timing:
  """Median wall time of ``compiled(*args)`` to completion, after ``warmup`` untimed calls.

  ``fresh_args``: for executables with donated arguments (consumed by each call), a maker of new
  inputs for every call; they are made and ready before the clock starts, and each call's outputs are
  dropped before the next inputs are made (so at most one set of inputs and outputs is live)."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")

  def call_args():
    return args if fresh_args is None else jax.block_until_ready(fresh_args())

  for _ in range(warmup):
    jax.block_until_ready(compiled(*call_args()))
  times = []
  for _ in range(repeats):
    a = call_args()
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*a))
    times.append(time.perf_counter() - t0)
    del a
  q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
  return Timing(
    statistics.median(times), min(times), max(times), q[2] - q[0], repeats, compile_s, q[0], q[2]
  )


# ------------------------------------------------------------------------------ parity on the device
def _check_error(actual, expected, quantity: str, dtype: str, reduction_len: int):
  """``bench.tolerances.parity_error`` (floor 0) as jnp: the same formula, reduced where the arrays
  live, in f32 (the NumPy path's f64 differs by f32 rounding of the ratio, ~1e-7 relative)."""
  import math

  import jax.numpy as jnp

  from bench.tolerances import F32_EPS, TABLE

  rtol_ulps, atol_ulps, acc = TABLE[quantity]
  eps = float(jnp.finfo(dtype).eps)
  a = actual.astype(jnp.float32)  # [...] any shape; bf16 / f16 widen exactly
  e = expected.astype(jnp.float32)  # [...] same shape
  scale = jnp.maximum(jnp.max(jnp.abs(e)), 1e-30)
  bound = scale * (atol_ulps * eps + acc * F32_EPS * math.sqrt(reduction_len))
  bound = bound + rtol_ulps * eps * jnp.abs(e)
  err = jnp.abs(a - e)
  worst = jnp.where(jnp.isfinite(err).any(), jnp.nanmax(err / bound), 0.0)
  return jnp.where((jnp.isnan(a) != jnp.isnan(e)).any(), jnp.inf, worst)


_check_error_jit = jax.jit(_check_error, static_argnums=(2, 3, 4))


def device_parity(actual_tree, expected_tree, checks) -> dict[str, float]:
  """{check label: worst error / tolerance over its outputs}, reduced on the arrays' device by one
  jitted jnp function per output: only scalars reach the host (a [N, V] gradient stays where it is).
  The single implementation behind the bench's parity column and the autotuner's correctness gate."""
  flat_a, flat_e = jax.tree.leaves(actual_tree), jax.tree.leaves(expected_tree)
  pending: dict[str, list] = {}
  for c in checks:
    for i in c.index if isinstance(c.index, tuple) else (c.index,):
      a, e = flat_a[i], flat_e[i]
      if a.shape != e.shape:
        err = float("inf")
      elif not e.size:
        err = 0.0
      else:
        err = _check_error_jit(a, e, c.quantity, str(c.dtype), int(c.reduction_len))
      pending.setdefault(c.label, []).append(err)
  got = jax.device_get(pending)  # one transfer of scalars
  return {label: max(float(x) for x in errs) for label, errs in got.items()}


# ----------------------------------------------------------------------------- memory between cases
def device_memory_limit(device=None) -> int | None:
  """Bytes the allocator may hand out on ``device`` (``memory_stats()['bytes_limit']``; None on
  backends that report no stats, e.g. CPU)."""
  device = device or jax.devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # not implemented on this backend
    return None
  return (stats or {}).get("bytes_limit")


def output_bytes(mem: Memory) -> int:
  """The executable's output bytes (0 where unknown)."""
  return mem.output_bytes or 0
