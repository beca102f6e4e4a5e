"""Each optimizer's element-wise math, written once: the Pallas kernel and the pure-JAX reference both
evaluate these rules (the kernel tile by tile, the reference on whole arrays).

A rule is a frozen dataclass of its static hyperparameters (validated on construction) with
  slots            names of its per-parameter f32 state arrays, e.g. ("mu", "nu");
  scalars(lr, c)   the traced per-step scalars the math needs (lr first; e.g. bias corrections);
  delta(p, g, scalars, *slots) -> (delta, new slots)   in f32, in optax's exact operation order.
A new optimizer is one such class (see :class:`SGD`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Interval:
  """A closed or half-open range of allowed values, printed as in the error message."""

  low: float
  high: float = math.inf
  high_open: bool = True
  low_open: bool = False

  def __contains__(self, x: float) -> bool:
    above = x > self.low if self.low_open else x >= self.low
    below = x < self.high if self.high_open else x <= self.high
    return above and below

  def __str__(self):
    hi = "inf" if self.high == math.inf else f"{self.high:g}"
    return f"{'(' if self.low_open else '['}{self.low:g}, {hi}{')' if self.high_open else ']'}"


UNIT = Interval(0.0, 1.0)  # [0, 1): decay rates
NON_NEGATIVE = Interval(0.0)  # [0, inf)
POSITIVE = Interval(0.0, low_open=True)  # (0, inf)


def check_range(name: str, value, allowed: Interval) -> None:
  """ValueError naming ``name`` unless ``value`` is a finite real scalar in ``allowed``. Traced values
  (under jit) cannot be checked here and pass through."""
  if isinstance(value, jax.core.Tracer):
    return
  try:
    if isinstance(value, bool | str | bytes) or np.ndim(value) != 0:
      raise TypeError
    number = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a real number in {allowed}, got {value!r}") from None
  if not math.isfinite(number) or number not in allowed:
    raise ValueError(f"{name} must be a finite number in {allowed}, got {number:g}")


@dataclasses.dataclass(frozen=True)
class Rule:
  """Base of the element-wise rules; subclasses declare ``slots``, ``ranges`` and ``delta``."""

  slots: ClassVar[tuple[str, ...]] = ()
  ranges: ClassVar[dict[str, Interval]] = {}

  def __post_init__(self):
    for name, allowed in self.ranges.items():
      check_range(name, getattr(self, name), allowed)
    for field in dataclasses.fields(self):  # switches (e.g. nesterov) must be real bools
      value = getattr(self, field.name)
      if isinstance(field.default, bool) and not isinstance(value, bool):
        raise ValueError(f"{field.name} must be a bool, got {value!r}")

  @property
  def decays_weights(self) -> bool:
    return bool(getattr(self, "weight_decay", 0.0))

  def without_weight_decay(self) -> Rule:
    """The rule for a leaf the weight-decay mask leaves out."""
    return dataclasses.replace(self, weight_decay=0.0) if self.decays_weights else self

  def scalars(self, lr, count) -> tuple[jax.Array, ...]:
    """The f32 scalars of the step taken when ``count`` steps are done (``lr`` first)."""
    del count
    return (jnp.asarray(lr, jnp.float32),)

  def delta(self, p, g, scalars, *slots):  # -> (delta, tuple of new slots)
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class AdamW(Rule):
  """optax.adamw: scale_by_adam -> add_decayed_weights -> scale_by_learning_rate."""

  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 1e-4
  slots: ClassVar = ("mu", "nu")
  ranges: ClassVar = {"b1": UNIT, "b2": UNIT, "eps": POSITIVE, "weight_decay": NON_NEGATIVE}

  def scalars(self, lr, count):
    # optax's bias corrections 1 - b ** (count + 1), in f32, for the step being taken
    count_inc = (jnp.asarray(count) + 1).astype(jnp.int32).astype(jnp.float32)
    return jnp.asarray(lr, jnp.float32), 1 - self.b1**count_inc, 1 - self.b2**count_inc

  def delta(self, p, g, scalars, mu, nu):
    lr, bc1, bc2 = scalars
    mu = (1 - self.b1) * g + self.b1 * mu
    nu = (1 - self.b2) * (g * g) + self.b2 * nu
    u = (mu / bc1) / (jnp.sqrt(nu / bc2) + self.eps)
    if self.weight_decay:
      u = u + self.weight_decay * p
    return (-lr) * u, (mu, nu)


@dataclasses.dataclass(frozen=True)
class Lion(Rule):
  """optax.lion: scale_by_lion -> add_decayed_weights -> scale_by_learning_rate."""

  b1: float = 0.9
  b2: float = 0.99
  weight_decay: float = 1e-3
  slots: ClassVar = ("mu",)
  ranges: ClassVar = {"b1": UNIT, "b2": UNIT, "weight_decay": NON_NEGATIVE}

  def delta(self, p, g, scalars, mu):
    (lr,) = scalars
    u = _sign((1 - self.b1) * g + self.b1 * mu)
    mu = (1 - self.b2) * g + self.b2 * mu
    if self.weight_decay:
      u = u + self.weight_decay * p
    return (-lr) * u, (mu,)


@dataclasses.dataclass(frozen=True)
class SGD(Rule):
  """optax.sgd(lr, momentum, nesterov): trace -> scale_by_learning_rate."""

  momentum: float = 0.9
  nesterov: bool = False
  slots: ClassVar = ("trace",)
  ranges: ClassVar = {"momentum": UNIT}

  def delta(self, p, g, scalars, trace):
    (lr,) = scalars
    trace = g + self.momentum * trace
    u = g + self.momentum * trace if self.nesterov else trace
    return (-lr) * u, (trace,)


def _sign(x):
  """jnp.sign, written with selects: Mosaic's sign lowering needs a TPU to query, and this lowers
  ahead of time from any host. NaN stays NaN (x * 0), as with jnp.sign."""
  return jnp.where(x > 0, 1.0, jnp.where(x < 0, -1.0, x * 0.0))
