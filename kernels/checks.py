"""Argument checks shared by the public kernels: one helper per concern, so every op says the same thing.

Each helper raises before anything is traced into a kernel, naming the argument and the allowed range.
Checks on array *values* (finiteness, index ranges) run only where the values are concrete; under
``jax.jit`` they are skipped and each op documents what such an input gives instead (a NaN that
poisons the affected result, never a silently wrong finite number).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class ArgumentTypeError(TypeError, ValueError):
  """A wrong type or dtype. A TypeError, and a ValueError so that one ``except ValueError`` catches
  every rejected argument (as numpy's AxisError is both an IndexError and a ValueError)."""


def is_concrete(*arrays) -> bool:
  """True when every array holds values (not a tracer under jit / grad / vmap)."""
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def as_array(name: str, x):
  """``x`` as a jax array: Python lists / tuples / numbers and numpy arrays are converted, so every
  impl accepts the same inputs. None stays None."""
  if x is None or isinstance(x, jax.Array):
    return x
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise ArgumentTypeError(f"{name} must be an array (or nested list of numbers): {e}") from e


def choice(name: str, value, allowed: Sequence) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def real(
  name: str,
  value,
  *,
  lo: float | None = None,
  hi: float | None = None,
  lo_open: bool = False,
  hi_open: bool = False,
) -> float:
  """A finite Python number in [lo, hi] (an open end excludes the bound); returns it as a float.

  The kernels bake these settings into the compiled code, so they must be Python numbers, not arrays.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ArgumentTypeError(
      f"{name} must be a Python number (it is a static kernel setting), got {type(value).__name__}"
    )
  value = float(value)
  lo_ok = lo is None or (value > lo if lo_open else value >= lo)
  hi_ok = hi is None or (value < hi if hi_open else value <= hi)
  if not (math.isfinite(value) and lo_ok and hi_ok):
    left = "(-inf" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
    right = "inf)" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
    raise ValueError(f"{name} must be finite and in {left}, {right}, got {value!r}")
  return value


def positive_int(name: str, value, *, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def positive_count(name: str, value) -> None:
  """A scalar divisor (e.g. a token count): > 0 and finite where concrete. Traced values pass."""
  if value is None or not is_concrete(value):
    return
  arr = np.asarray(value)
  if arr.ndim != 0:
    raise ValueError(f"{name} must be a scalar, got shape {arr.shape}")
  if not np.issubdtype(arr.dtype, np.number) or isinstance(value, bool):
    raise ArgumentTypeError(f"{name} must be a number, got {arr.dtype}")
  if not (np.isfinite(arr) and arr > 0):
    raise ValueError(f"{name} must be finite and > 0, got {value!r}")


def ndim_array(name: str, x, ndim: int, layout: str) -> None:
  if getattr(x, "ndim", None) != ndim:
    raise ValueError(f"{name} must be {layout}, got shape {getattr(x, 'shape', None)}")


def shape(name: str, x, expected: tuple, context: str = "") -> None:
  if x is not None and tuple(jnp.shape(x)) != tuple(expected):
    raise ValueError(
      f"{name} must have shape {tuple(expected)}{context}, got {tuple(jnp.shape(x))}"
    )


def dtype_kind(name: str, x, kind: str) -> None:
  """kind: "floating" or "integer"."""
  if x is None:
    return
  want = {"floating": jnp.floating, "integer": jnp.integer}[kind]
  if not jnp.issubdtype(jnp.result_type(x), want):
    raise ArgumentTypeError(f"{name} must have a {kind} dtype, got {jnp.result_type(x)}")


def finite(name: str, x, where=None, *, allow_neg_inf: bool = False) -> None:
  """Where concrete: no NaN / inf in ``x`` (at positions where ``where`` is true, if given).

  allow_neg_inf: -inf is a legal value (a log-probability of an impossible token).
  """
  if x is None or not is_concrete(x, where):
    return
  arr = np.asarray(x)
  bad = np.isnan(arr) | (arr == np.inf) if allow_neg_inf else ~np.isfinite(arr)
  if where is not None:
    bad &= np.broadcast_to(np.asarray(where) != 0, bad.shape)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    kinds = "NaN or +inf" if allow_neg_inf else "NaN or inf"
    place = " at unmasked positions" if where is not None else ""
    raise ValueError(
      f"{name} has {int(bad.sum())} {kinds} values{place}; first at {first}: {arr[first]}"
    )


def real_array(name: str, x, *, hi: float, where=None, allow_neg_inf: bool = False) -> None:
  """Where concrete: every value of ``x`` a number <= ``hi`` (at positions where ``where`` is true, if
  given): no NaN, no +inf, none above ``hi``; -inf only with ``allow_neg_inf``."""
  finite(name, x, where=where, allow_neg_inf=allow_neg_inf)
  if x is None or not is_concrete(x, where):
    return
  arr = np.asarray(x)
  bad = arr > hi
  if where is not None:
    bad &= np.broadcast_to(np.asarray(where) != 0, bad.shape)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    place = " at unmasked positions" if where is not None else ""
    raise ValueError(
      f"{name} must be <= {hi}{place}; {int(bad.sum())} values above it, first at {first}: "
      f"{arr[first]}"
    )


def index_range(name: str, ids, hi: int, where=None, qualifier: str = "") -> None:
  """Where concrete: every id in [0, hi) (at positions where ``where`` is true, if given).

  qualifier: a word for the checked positions in the message (e.g. "unmasked").
  """
  if not is_concrete(ids, where):
    return
  arr = np.asarray(ids)
  bad = (arr < 0) | (arr >= hi)
  if where is not None:
    bad &= np.broadcast_to(np.asarray(where) != 0, bad.shape)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    what = f"{qualifier} {name}" if qualifier else name
    raise ValueError(
      f"{int(bad.sum())} {what} outside [0, {hi}); first at {first}: {int(arr[first])}"
    )


def loss_scale(value):
  """``loss_scale=`` of the loss ops: None, or an f32 scalar carrying no gradient (a micro-batch's
  share of the global loss). ArgumentTypeError for a non-numeric or non-scalar value, ValueError for a
  non-finite one (where concrete)."""
  if value is None:
    return None
  value = as_array("loss_scale", value)
  if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.number):
    raise ArgumentTypeError(
      f"loss_scale must be a numeric scalar, got {value.dtype}{list(value.shape)}"
    )
  finite("loss_scale", value)
  return jax.lax.stop_gradient(value.astype(jnp.float32))
