"""The one tolerance table. Never loosen an entry to make a test pass: find the bug instead.

An error budget has two parts: rounding of the compared array to its own dtype (``ulps`` of that
dtype), and float32 accumulation over the reduction (``acc`` f32 epsilons times sqrt(reduction length)).
Both are relative to ``scale``, the largest magnitude of the reference.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

__all__ = ["FLOOR_FACTOR", "TABLE", "assert_close", "parity_error", "tolerance"]

F32_EPS = float(np.finfo(np.float32).eps)

# quantity -> (rtol in ulps of the compared dtype, atol in ulps of it, acc: f32 eps per sqrt(len))
TABLE = {
  "value": (64, 4, 8),  # loss and per-token f32 outputs (logp, entropy, kl), any input dtype
  "grad": (2, 1, 8),  # gradients, stored in the input dtype
  "f64_check": (64, 4, 8),  # the f32 reference against an independent float64 NumPy formula
  "optimizer": (4, 4, 0),  # element-wise updates: same ops, only fusion / rounding order may differ
  "attention": (4, 2, 8),  # attention outputs in q's dtype: p is rounded to it for the PV matmul
}

# A whole-model comparison (an engine's sampler log-probs vs a teacher-forced forward of the same
# tokens) also carries the model's own sensitivity to evaluation order, which the per-reduction budget
# does not model: the bench's x10-scaled random models amplify f32 rounding through every layer. It is
# measured, not assumed: `floor` = the largest change of the teacher-forced forward when the rows are
# laid out with more left padding (exact in real arithmetic; 3e-5 - 1.1e-4 nats on the h128 model).
# A re-layout perturbs only the attention sums, a cached decoder every matmul: correct engines
# measured up to 3.9x that floor (12 sglang-jax generations, ours up to 2.2x), hence 8x is allowed.
# A wrong engine (stale weights, a wrong page) is off by nats, thousands of floors.
FLOOR_FACTOR = 8.0


def tolerance(quantity: str, dtype, reduction_len: int, scale: float = 1.0) -> dict:
  """``rtol`` / ``atol`` for ``np.testing.assert_allclose``."""
  rtol_ulps, atol_ulps, acc = TABLE[quantity]
  eps = float(jnp.finfo(dtype).eps)  # jnp.finfo knows bfloat16
  scale = max(float(scale), 1e-30)
  return dict(
    rtol=rtol_ulps * eps, atol=scale * (atol_ulps * eps + acc * F32_EPS * math.sqrt(reduction_len))
  )


def parity_error(
  actual, expected, quantity: str, dtype, reduction_len: int, floor: float = 0.0
) -> float:
  """Largest |actual - expected| / max(atol + rtol * |expected|, FLOOR_FACTOR * floor): <= 1 is
  within tolerance. `floor`: the reference's own measured re-layout change (see FLOOR_FACTOR)."""
  actual = np.asarray(actual, dtype=np.float64)
  expected = np.asarray(expected, dtype=np.float64)
  if actual.shape != expected.shape:
    return float("inf")
  if not expected.size:
    return 0.0
  tol = tolerance(quantity, dtype, reduction_len, float(np.max(np.abs(expected))))
  bound = np.maximum(tol["atol"] + tol["rtol"] * np.abs(expected), FLOOR_FACTOR * floor)
  err = np.abs(actual - expected)
  nan_mismatch = np.isnan(actual) != np.isnan(expected)
  if nan_mismatch.any():
    return float("inf")
  return float(np.nanmax(err / bound)) if np.isfinite(err).any() else 0.0


def assert_close(
  actual,
  expected,
  quantity: str,
  dtype,
  reduction_len: int,
  err_msg: str = "",
  scale: float | None = None,
):
  """Compare ``actual`` to ``expected`` (both cast to f64) under the budget for ``dtype`` arrays.

  ``scale`` defaults to max |expected|. Pass the operands' magnitude when the result is a difference
  of larger terms (e.g. a moment update that nearly cancels): rounding is relative to the terms.
  """
  actual = np.asarray(actual, dtype=np.float64)
  expected = np.asarray(expected, dtype=np.float64)
  if scale is None:
    scale = float(np.max(np.abs(expected))) if expected.size else 1.0
  np.testing.assert_allclose(
    actual, expected, err_msg=err_msg, **tolerance(quantity, dtype, reduction_len, scale)
  )
