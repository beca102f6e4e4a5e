"""The dense engine's KV cache: `rl.model.cache.DenseKVCache`'s layout and attention, with the values
held as their bits so the per-token write is an integer scatter.

Why not DenseKVCache itself: its bf16 scatter is one XLA:CPU upcasts whole — the [L, B, S, Hkv, D]
cache converted to f32, scattered and converted back, per layer per step (bench.byte_account: ~120 GB
of the 0.5B-shape decode step's charges). The bits are exact, so the values and the attention are
DenseKVCache's; `layer` may be a Python int or a traced int32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rl.model.cache import attention


@dataclasses.dataclass(frozen=True)
class DenseBitsCache:
  """A contiguous cache: slot s of sequence b holds the token at position s (see DenseKVCache)."""

  k: jax.Array  # [L, B, S, Hkv, D] the values' bits (uint of the value dtype's width)
  v: jax.Array  # [L, B, S, Hkv, D]
  value_dtype: str = "bfloat16"

  @classmethod
  def create(
    cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
  ) -> DenseBitsCache:
    dtype = jnp.dtype(dtype)
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    bits = jnp.dtype(f"uint{8 * dtype.itemsize}")
    return cls(jnp.zeros(shape, bits), jnp.zeros(shape, bits), dtype.name)

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def values(self, x):  # bits -> the value dtype
    return jax.lax.bitcast_convert_type(x, jnp.dtype(self.value_dtype))

  def attend(self, layer, q, k, v, positions):
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], positions [B, T] -> ([B, T, Hq, D], cache)."""
    rows = jnp.arange(q.shape[0])[:, None]
    as_bits = lambda x: jax.lax.bitcast_convert_type(
      x.astype(jnp.dtype(self.value_dtype)), self.k.dtype
    )
    # Positions past the cache (padding beyond max_len) are dropped, never wrapped onto real slots.
    new_k = self.k.at[layer, rows, positions].set(as_bits(k), mode="drop")
    new_v = self.v.at[layer, rows, positions].set(as_bits(v), mode="drop")
    visible = jnp.arange(self.max_len)[None, None, :] <= positions[:, :, None]
    kd, vd = self.values(new_k[layer]), self.values(new_v[layer])
    out = attention(q, kd.astype(q.dtype), vd.astype(q.dtype), visible)
    return out, dataclasses.replace(self, k=new_k, v=new_v)


jax.tree_util.register_dataclass(
  DenseBitsCache, data_fields=["k", "v"], meta_fields=["value_dtype"]
)
