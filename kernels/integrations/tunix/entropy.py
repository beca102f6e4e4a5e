"""The entropy bonus of tunix's PPO loss, differentiable, composed outside the loss kernels.

Tunix's ``ppo_policy_loss_fn`` subtracts ``entropy_coef * masked_mean(H)`` with H the entropy of
softmax(logits) *with its gradient*; the kernels report the entropy without one (``LossSpec`` has no
entropy coefficient). So the term is built here in XLA:

* :func:`from_logits` — on the [B, T, V] logits the ``"ppo_kernels"`` path already holds;
* :func:`from_hidden` — for ``"ppo_kernels_fused"``: the logits of one chunk of tokens at a time
  (``jax.lax.map`` over a ``jax.checkpoint``-ed chunk), so the [B, T, V] logits never exist, in the
  forward or the backward (which recomputes each chunk's [chunk, V] logits). Cost: one extra
  forward matmul and, in the backward, the recompute plus two matmuls (dhidden, dhead) per chunk,
  and a second [D, V] head gradient (the entropy's, in the head's dtype) summed into the kernel's.
  ``LossSpec`` with an entropy coefficient would fold -c dH/dlogits into the kernels' own dlogits
  and need none of this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK_BYTES = 2**30  # the f32 [chunk, V] logits of one chunk stay under 1 GiB


def from_logits(logits):  # [..., V] -> [...] f32
  """H(softmax(logits)) in f32, differentiable; -inf logits (p = 0) add 0 and a finite gradient."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1)


def default_chunk(n: int, v: int) -> int:
  """Tokens per chunk: the largest power of two with f32 [chunk, V] under CHUNK_BYTES, at most N
  rounded up to a power of two (at least 1)."""
  chunk = 1
  while chunk < n and chunk * 2 * v * 4 <= CHUNK_BYTES:
    chunk *= 2
  return chunk


def from_hidden(
  hidden,  # [B, T, D]: final-norm hidden states (rows to skip zeroed by the caller)
  head,  # [D, V], hidden's dtype
  chunk: int | None = None,
):  # -> [B, T] f32
  """H(softmax(hidden @ head)) per token, differentiable w.r.t. hidden and head, one chunk of
  ``chunk`` tokens at a time (default :func:`default_chunk`). The chunk's logits are computed in
  hidden's dtype and then cast to f32, as tunix's models compute theirs (einsum in the model dtype,
  then f32): the same values as tunix's entropy, and a backward whose head gradient is in the
  head's dtype (no f32 [D, V] buffer beside the loss kernel's own head gradient)."""
  b, t, d = hidden.shape
  n = b * t
  chunk = default_chunk(n, head.shape[1]) if chunk is None else chunk
  rows = jnp.pad(hidden.reshape(n, d), ((0, -n % chunk), (0, 0))).reshape(-1, chunk, d)

  @jax.checkpoint  # keep only the chunk's hidden rows; the backward recomputes its logits
  def one(x):  # [chunk, D] -> [chunk]
    return from_logits(jnp.dot(x, head))

  return jax.lax.map(one, rows).reshape(-1)[:n].reshape(b, t)
