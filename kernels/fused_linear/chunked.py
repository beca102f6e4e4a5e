"""The chunked path: XLA matmuls per token chunk, the softmax math in `kernels.grpo_loss`'s Pallas kernels.

For each chunk of c tokens: f32 logits [c, V] = h_c @ w (XLA, tensor cores / MXU), the grpo_loss
forward kernel's row statistics, then — in the same pass, when a token's loss weight depends on that
token alone (every token-level option) — its backward kernel writes dl over the logits buffer in place,
and two more XLA matmuls give dh_c and accumulate dw. 6 N·H·V flops in all (the minimum) with one
[c, V] f32 buffer alive: the Liger-Kernel recipe, in JAX, with a Pallas softmax that runs on TPU, GPU
(Triton) and CPU. The sequence-level options (GSPO, sequence importance weights) know a token's
weight only once every chunk of its sequence is seen: there a statistics pass (:func:`run` without
gradients) precedes a gradient pass (:func:`run_grads`) that recomputes the logits (8 N·H·V flops).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels.fused_linear import gap as _gap
from kernels.grpo_loss import pallas as loss_pallas
from kernels.grpo_loss.pallas_blocks import LossConfig


def chunk_pass(loss_cfg: LossConfig, h, w, ids, finish, with_grads: bool = True, thr=None):
  """One chunk: statistics -> ``finish`` (combine across shards, loss terms) -> gradients (if asked).

  h: [c, H]; w: [H, V] (one vocabulary shard); ids: [c] int32 shard-local; thr: [c] f32 support
  thresholds (:mod:`.gap`) or None. finish(lse, chosen, found, ez) -> (global lse [c], g [c], outputs).
  Returns (outputs, dh [c, H] f32 (this shard's part), dw [H, V] f32).
  """
  logits = _logits(loss_cfg, h, w, ids, thr)
  lse, logp, entropy = loss_pallas.row_stats(loss_cfg, logits, ids)
  # the ids this shard holds, from the ids themselves: a NaN test of logp (logp == logp) lost the
  # NaN under jit on XLA:CPU once row_stats' NaN came from a select outside the kernel (an id
  # outside [0, V) then gave a finite loss: tests/kernels/fused_linear/test_fused_linear.py's bad-ids test)
  found = (ids >= 0) & (ids < w.shape[1])
  chosen = jnp.where(found, logp + lse, 0.0)
  lse_global, g, outputs = finish(lse, chosen, found.astype(jnp.float32), lse - entropy)
  if not with_grads:
    return outputs, None, None
  return (outputs, *_grads(loss_cfg, logits, h, w, ids, lse_global, g))


def _logits(loss_cfg: LossConfig, h, w, ids, thr):
  """The chunk's f32 logits [c, V]; with thresholds, -inf outside each row's sampled support (the
  softmax kernels then score over S: -inf columns are exact zeros of p, entropy and dl)."""
  logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
  return logits if thr is None else _gap.keep_raw(logits, ids, thr, loss_cfg.temperature)


def _grads(loss_cfg, logits, h, w, ids, lse_global, g):
  """(dh [c, H] f32, dw [H, V] f32) from the chunk's f32 logits, the global lse and g [c]."""
  in_place = dataclasses.replace(loss_cfg, reuse_logits_buffer=True)
  dl = loss_pallas.softmax_grad(in_place, logits, ids, lse_global, g).astype(h.dtype)
  dh = jnp.dot(dl, w.T, preferred_element_type=jnp.float32)
  dw = jnp.dot(h.T, dl, preferred_element_type=jnp.float32)
  return dh, dw


def run(
  loss_cfg: LossConfig,
  chunk: int,
  h,
  w,
  ids,
  per_token,
  finish,
  with_grads: bool = True,
  thr=None,
):
  """All tokens in chunks of ``chunk`` (zero-padded at the end; padded rows must get g = 0).

  per_token: a tuple of [N] arrays handed to ``finish`` chunk by chunk, as its fifth argument.
  thr: [N] f32 support thresholds or None (:func:`chunk_pass`).
  Returns (outputs [N], dh [N, H] f32, dw [H, V] f32); without ``with_grads``, (outputs, None, None).
  """
  n, _hd = h.shape
  pad = -n % chunk
  padded = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
    -1, chunk, *a.shape[1:]
  )
  xs = (padded(h), padded(ids), tuple(padded(a) for a in per_token), _opt(padded, thr))

  unpad = lambda a: a.reshape(-1, *a.shape[2:])[:n]

  def body(dw_acc, x):
    h_c, ids_c, tok_c, thr_c = x
    outputs, dh_c, dw_c = chunk_pass(
      loss_cfg, h_c, w, ids_c, lambda *stats: finish(*stats, tok_c), with_grads, thr_c
    )
    if not with_grads:
      return dw_acc, outputs
    return dw_acc + dw_c, (outputs, dh_c)

  if not with_grads:
    _, outputs = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return jax.tree.map(unpad, outputs), None, None
  dw, (outputs, dh) = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  return jax.tree.map(unpad, outputs), unpad(dh), dw


def _opt(f, a):
  return None if a is None else f(a)


def run_grads(loss_cfg: LossConfig, chunk: int, h, w, ids, lse, g, thr=None):
  """The gradient pass alone: (dh [N, H] f32, dw [H, V] f32) for known global lse [N] and g [N]
  (padded rows get g = 0; thr: [N] support thresholds or None). Recomputes each chunk's logits."""
  n, _hd = h.shape
  pad = -n % chunk
  padded = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
    -1, chunk, *a.shape[1:]
  )

  def body(dw_acc, x):
    h_c, ids_c, lse_c, g_c, thr_c = x
    logits = _logits(loss_cfg, h_c, w, ids_c, thr_c)  # [c, V]
    dh_c, dw_c = _grads(loss_cfg, logits, h_c, w, ids_c, lse_c, g_c)
    return dw_acc + dw_c, dh_c

  xs = (padded(h), padded(ids), padded(lse), padded(g), _opt(padded, thr))
  dw, dh = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  return dh.reshape(-1, dh.shape[-1])[:n], dw
