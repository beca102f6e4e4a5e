"""Bench cases are data: each names its inputs, kernel, reference, bytes, flops and parity checks.

``nox -s bench`` (``python -m bench``) and ``pytest --benchmark-only`` (tests/bench/) both iterate
:func:`all_cases`, so the two entry points can never drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

SIZES = (
  "tiny",
  "small",
  "large",
)  # tiny: the harness's own smoke test; small: CPU; large: real shapes


@dataclasses.dataclass(frozen=True)
class Check:
  """Compare flattened output ``index`` of kernel and reference under the tolerance table."""

  index: int | tuple[int, ...]  # one flattened output, or several (the worst one counts)
  quantity: str  # a key of bench.tolerances.TABLE
  dtype: str  # dtype whose rounding the budget allows for
  reduction_len: int
  label: str


@dataclasses.dataclass(frozen=True)
class Case:
  op: str
  shape_name: str
  mode: str  # "fwd" | "fwd+bwd"
  make_inputs: Callable[[int], tuple]  # seed -> positional args (device arrays)
  kernel: Callable  # args -> pytree of outputs
  reference: Callable  # same contract, the pure-JAX reference
  bytes: float | None  # ideal HBM traffic of the op
  flops: float | None
  checks: tuple[Check, ...]
  params: dict = dataclasses.field(default_factory=dict)  # shape details for the report
  # Arguments both sides update in place (e.g. an optimizer's params and state). Donated inputs are
  # consumed by the call, so each timed call gets fresh inputs from make_inputs (made outside the timer)
  # and parity compares kernel and reference on two fresh copies of the same seed's inputs.
  donate_argnums: tuple[int, ...] = ()
  # () -> why the case cannot run beside this install (an optional peer that does not install with
  # our jax), or None: such a case is a skipped row with that reason, never a failure
  unavailable: Callable[[], str | None] | None = None

  @property
  def name(self) -> str:
    return f"{self.op}/{self.shape_name}/{self.mode}"


SUITES = ("grpo_loss", "fused_linear", "paged_attention", "optim", "mosaic_gpu")


def all_cases(size: str, platform: str, suites: tuple[str, ...] | None = None) -> list[Case]:
  """Every selected suite's cases at ``size`` for kernels targeting ``platform``."""
  from bench.kernels.cases import fused_linear, grpo_loss, mosaic_gpu, optim, paged_attention

  registry = {
    "grpo_loss": grpo_loss.cases,
    "fused_linear": fused_linear.cases,
    "paged_attention": paged_attention.cases,
    "optim": optim.cases,
    "mosaic_gpu": mosaic_gpu.cases,  # the Mosaic GPU rows of grpo_loss and paged_attention
  }
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")
  unknown = sorted(set(suites or ()) - set(registry))
  if unknown:
    raise ValueError(f"unknown suite(s) {unknown}; available: {sorted(registry)}")
  return [case for suite in (suites or registry) for case in registry[suite](size, platform)]
