"""The KV-cache interface the decoder attends through, and the dense cache that implements it.

The decoder does not own its cache: prefill and decode call `cache.attend(layer, q, k, v, positions)`
(with `invariant=True` under ModelConfig.batch_invariant),
which stores the new keys/values wherever the cache keeps them and returns the attention output. The
rollout engine supplies the cache: `DenseKVCache` here (one contiguous [S] slab per sequence, the way
tunix and MLLM-JAX sample; the dense engine's), a paged cache over `kernels.paged_attention` in `rl.rollout`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from rl.model import numerics

Array = jax.Array

# A masked score; finite so a query with no visible key (padding) gives a uniform row, not NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(Protocol):
  """What a decoder layer needs from a cache. Implementations are pytrees (they cross `jax.jit`)."""

  def attend(
    self,
    layer: Array | int,
    q: Array,
    k: Array,
    v: Array,
    positions: Array,
    *,
    invariant: bool = False,
  ) -> tuple[Array, KVCache]:
    """Stores `k`/`v` of the new tokens and attends `q` to every cached token at or before its position.

    Args:
      layer: the decoder layer: a traced int32 scalar under the decoder's layer scan (a Python int
        outside it); index the stacked [L, ...] buffers with it, never branch on it in Python.
      q: [B, T, Hq, D] queries of the new tokens, RoPE applied.
      k: [B, T, Hkv, D] keys of the new tokens, RoPE applied.
      v: [B, T, Hkv, D] values of the new tokens.
      positions: [B, T] int32 absolute position of each new token.
      invariant: ModelConfig.batch_invariant: the same bits as `attention(..., invariant=True)` of the
        teacher-forced forward gives the token (a cache that cannot, e.g. a decode kernel with its own
        reduction order, raises ValueError).

    Returns:
      ([B, T, Hq, D] attention output, the updated cache).
    """
    ...


def attention(
  q: Array,  # [B, T, Hq, D]
  k: Array,  # [B, S, Hkv, D]
  v: Array,  # [B, S, Hkv, D]
  visible: Array,  # [B, T, S] bool: query t may attend to key s
  invariant: bool = False,  # ModelConfig.batch_invariant (rl.model.numerics)
) -> Array:  # [B, T, Hq, D]
  """Grouped-query softmax attention with f32 scores; the q heads of one kv head share its keys."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d)
  if invariant:
    return _invariant_attention(qg, k, v, visible).reshape(b, t, hq, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
  scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  # The output is rounded to q's dtype anyway; asking for it directly (accelerators still accumulate
  # in f32) also avoids XLA:CPU's unfused bf16 x bf16 -> f32 batched dot, which it cannot execute.
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, hq, d).astype(q.dtype)


def _invariant_attention(
  qg: Array,  # [B, T, Hkv, G, D]
  k: Array,  # [B, S, Hkv, D]
  v: Array,  # [B, S, Hkv, D]
  visible: Array,  # [B, T, S] bool
) -> Array:  # [B, T, Hkv, G, D]
  """`attention` under ModelConfig.batch_invariant: a fixed-order softmax denominator, f32
  accumulation of p @ v rounded once. One query row (a decode step of a model with one q head per kv
  head) is computed as two: XLA:CPU runs a one-row product as a matrix-vector kernel, which sums in
  another order than the matrix-matrix kernel of the teacher-forced forward."""
  g = qg.shape[3]
  if qg.shape[1] * g == 1:
    qg = jnp.concatenate([qg, qg], axis=3)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  scores = jnp.where(visible[:, None, None], scores * (qg.shape[-1] ** -0.5), MASK_VALUE)
  probs = numerics.round_to(numerics.softmax(scores), v.dtype)
  # p @ v as products summed by pairwise_sum: XLA:CPU's matmul kernels for it sum in an order that
  # depends on the query count, and cannot run it in bf16 -> f32 where they do not fuse it.
  vt = v.astype(jnp.float32).transpose(0, 2, 3, 1)[:, :, None, None]  # [B, Hkv, 1, 1, D, S]
  products = probs.astype(jnp.float32)[:, :, :, :, None, :] * vt  # [B, Hkv, G, T, D, S]
  out = numerics.pairwise_sum(products).transpose(0, 3, 1, 2, 4)  # [B, T, Hkv, G, D]
  return numerics.round_to(out[:, :, :, :g], qg.dtype)


@dataclasses.dataclass(frozen=True)
class DenseKVCache:
  """A contiguous cache: slot s of sequence b holds the token at position s.

  Prompts are right-padded: a padding token's key lands at a position no real query of that row can
  see before a real token overwrites it (decode writes at the sequence's next position).

  Storage: `create` keeps the values as their bits (an unsigned integer of the value dtype's width,
  `value_dtype` naming the values' dtype), so the per-token write is an integer scatter: XLA:CPU runs
  a bf16 scatter as an f32 round trip of the whole [L, B, S, Hkv, D] cache per layer per step
  (bench.rollout.byte_account: ~120 GB of the 0.5B-shape decode step), an integer one in place. The bits are
  exact: values and attention are the same either way. `value_dtype=None`: k / v hold the values.
  """

  k: Array  # [L, B, S, Hkv, D] the values, or their bits
  v: Array  # [L, B, S, Hkv, D]
  value_dtype: str | None = None

  @classmethod
  def create(
    cls,
    num_layers: int,
    batch: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    bits: bool = True,
    sharding: jax.sharding.Sharding | None = None,  # of k / v; None: the default device
  ) -> DenseKVCache:
    dtype = jnp.dtype(dtype)
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    storage = jnp.dtype(f"uint{8 * dtype.itemsize}") if bits else dtype
    zeros = lambda: jnp.zeros(shape, storage, device=sharding)
    return cls(zeros(), zeros(), dtype.name if bits else None)

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def dtype(self):
    """The dtype of the cached values."""
    return jnp.dtype(self.value_dtype or self.k.dtype)

  def values(self, x):  # [..] storage -> the same in the value dtype
    return x if self.value_dtype is None else jax.lax.bitcast_convert_type(x, self.dtype)

  def _stored(self, x):  # [..] values -> storage
    x = x.astype(self.dtype)
    return x if self.value_dtype is None else jax.lax.bitcast_convert_type(x, self.k.dtype)

  def attend(self, layer, q, k, v, positions, *, invariant=False):
    # `layer` (traced or not) joins rows and positions as one more advanced index: a scatter of the
    # [B, T] new tokens into the carried buffer (in place under the scan), never a copy of the slab.
    rows = jnp.arange(q.shape[0])[:, None]
    # Positions past the cache (padding beyond max_len) are dropped, never wrapped onto real slots.
    new_k = self.k.at[layer, rows, positions].set(self._stored(k), mode="drop")
    new_v = self.v.at[layer, rows, positions].set(self._stored(v), mode="drop")
    visible = jnp.arange(self.max_len)[None, None, :] <= positions[:, :, None]
    kd, vd = self.values(new_k[layer]), self.values(new_v[layer])
    out = attention(q, kd.astype(q.dtype), vd.astype(q.dtype), visible, invariant)
    return out, dataclasses.replace(self, k=new_k, v=new_v)


jax.tree_util.register_dataclass(DenseKVCache, data_fields=["k", "v"], meta_fields=["value_dtype"])
