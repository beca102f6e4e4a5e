"""The critic: a value head, one linear layer on the policy's final hidden states (H -> 1), or a
separate model (its own transformer trunk with such a head; `train.critic=model`).

The head reads the same hidden states that score each completion token, so value[t] estimates the
return from the state in which token t is chosen; it never builds an [N, V] array (its output is
[N]), and its value gradient also reaches the policy's trunk. A separate critic model reads the
same token positions through its own trunk: the value loss trains it alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rl.update import completion_hidden


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


class CriticModel(nnx.Module):
  """A separate critic: `trunk` (a Qwen model sharing the policy's tokenizer, any size) and a value
  head on its final hidden states."""

  def __init__(self, trunk: nnx.Module, hidden_size: int, *, rngs: nnx.Rngs | None = None):
    self.trunk = trunk
    self.head = ValueHead(hidden_size, rngs=rngs)

  def values(
    self,
    tokens: jax.Array,  # [M, P + C] int
    attention_mask: jax.Array,  # [M, P + C] bool
    completion_len: int,
  ) -> jax.Array:  # [M, C] f32
    return self.head(completion_hidden(self.trunk, tokens, attention_mask, completion_len))


def critic_values(
  critic: ValueHead | CriticModel,
  policy_hidden: jax.Array,  # [M, C, H] the policy's states scoring the completion tokens
  tokens: jax.Array,  # [M, P + C] int
  attention_mask: jax.Array,  # [M, P + C] bool
  completion_len: int,
) -> jax.Array:  # [M, C] f32
  if isinstance(critic, CriticModel):
    return critic.values(tokens, attention_mask, completion_len)
  return critic(policy_hidden)
