"""One leaf's part of a multi-tensor launch (:class:`LeafWork`: its body, inputs and outputs), as
:mod:`kernels.optim.leaf` builds it and every impl evaluates it: the XLA reference
(:mod:`kernels.optim.reference`) and both Pallas families (:mod:`kernels.optim.pallas`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LeafWork(NamedTuple):
  """One leaf's part of a launch: ``body(scalars, *f32 [block] inputs) -> f32 [block] outputs``;
  inputs: name -> [...] array (one shape); outputs: name -> dtype, in the order body returns them;
  key: leaves with equal keys have interchangeable bodies (None: this leaf's own)."""

  body: Callable
  inputs: dict[str, jax.Array]
  outputs: dict[str, Any]
  key: Hashable = None


def split_empty(work: Sequence[LeafWork]) -> tuple[list[dict | None], list[int]]:
  """(results with an empty leaf's outputs filled in — zero-size arrays: nothing to walk, no
  program —, the indices of the leaves a launch must walk)."""
  results: list[dict | None] = [None] * len(work)
  live = []
  for i, w in enumerate(work):
    shape = next(iter(w.inputs.values())).shape
    if math.prod(shape) == 0:
      results[i] = {k: jnp.zeros(shape, d) for k, d in w.outputs.items()}
    else:
      live.append(i)
  return results, live
