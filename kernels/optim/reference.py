"""The pure-JAX twin of the multi-tensor kernels (:mod:`kernels.optim.pallas_triton`, :mod:`kernels.optim.pallas_tpu`):
the same body (built from a rule in :mod:`kernels.optim.rules`) evaluated on whole f32 arrays, which
XLA fuses into one loop.

The tests check both against ``optax`` itself (``optax.adamw`` / ``optax.lion`` / ``optax.sgd``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def elementwise_reference(body, inputs: dict[str, jax.Array], outputs: dict, scalars):
  """``body(scalars, *f32 inputs) -> f32 outputs`` on whole arrays; outputs cast to their dtypes.

  inputs: name -> [...] array, one shape; outputs: name -> dtype; scalars: tuple of f32 [].
  """
  outs = body(scalars, *(jnp.asarray(a).astype(jnp.float32) for a in inputs.values()))
  return {k: o.astype(dtype) for (k, dtype), o in zip(outputs.items(), outs)}
