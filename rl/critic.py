"""The critic: a value head, one linear layer on the policy's final hidden states (H -> 1).

It reads the same hidden states that score each completion token, so value[t] estimates the return
from the state in which token t is chosen; it never builds an [N, V] array (its output is [N])."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class ValueHead(nnx.Module):
  """Zero-initialised (every value starts at 0: no random baseline at step 0), float32 output."""

  def __init__(self, hidden_size: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    self.proj = nnx.Linear(
      hidden_size,
      1,
      kernel_init=nnx.initializers.zeros_init(),
      bias_init=nnx.initializers.zeros_init(),
      param_dtype=param_dtype,
      dtype=jnp.float32,
      rngs=rngs or nnx.Rngs(0),
    )

  def __call__(self, hidden: jax.Array) -> jax.Array:  # [..., H] -> [...] f32
    return self.proj(hidden.astype(jnp.float32))[..., 0]
