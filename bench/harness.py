"""Compile once, warm up, time the median of repeats with ``block_until_ready``; memory from XLA."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
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
  compiled, args: tuple, *, warmup: int = 2, repeats: int = 10, compile_s: float = 0.0
) -> Timing:
  """Median wall time of ``compiled(*args)`` to completion, after ``warmup`` untimed calls."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
  return Timing(
    statistics.median(times), min(times), max(times), q[2] - q[0], repeats, compile_s, q[0], q[2]
  )
