"""The ``pallas`` impl of the GRPO loss: one entry over its two kernel families, chosen by the target.

  tiled   (TPU, CPU interpreter): :mod:`kernels.grpo_loss.pallas_tpu`
  rowloop (GPU / Triton):         :mod:`kernels.grpo_loss.pallas_triton`

Each family has the same three kernels: the statistics forward (per token row: an online max /
sum-exp over the vocabulary, the chosen token's logit and the entropy's running sum, finished into
(log p, entropy) and the saved log-sum-exp), the backward (dlogits = g / T * (onehot(id) - softmax(z))
tile by tile from the saved log-sum-exp) and the training-path forward that also writes dlogits.

These are the three-pass pieces (statistics, then [B, T] objective, then backward): what runs for
sequence-level specs, for callers that differentiate aux outputs, and for the fused LM-head loss
(:mod:`kernels.fused_linear.chunked` calls :func:`row_stats` and :func:`softmax_grad`). The training
path for token-level specs (:func:`train_fwd`: one kernel for statistics, the in-kernel coefficient
of :mod:`kernels.grpo_loss.train` and dlogits) runs under the custom VJP of
:mod:`kernels.grpo_loss.vjp`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.grpo_loss import pallas_tpu, pallas_triton
from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.grpo_loss.train import TrainConfig


def _family(target):
  """The kernel module of ``target``'s family."""
  return pallas_triton if target.family == "rowloop" else pallas_tpu


def fwd_call(cfg: LossConfig, *args):
  """The statistics kernel: (logp, entropy, lse_rel, shift) [N] f32 of logits [N, V] and ids [N]."""
  return _family(cfg.target).fwd(cfg, *args)


def bwd_call(cfg: LossConfig, *args):
  """The backward kernel: dlogits [N, V] of (logits, ids, lse_rel, shift, g)."""
  return _family(cfg.target).bwd(cfg, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def token_logps(cfg: LossConfig, logits, ids):
  """(logp, entropy) of flat tokens, [N] f32 each; differentiable w.r.t. logits through logp.

  logits: [N, V] bf16/f32; ids: [N] int32 (outside [0, V): logp NaN). The entropy carries no gradient.
  """
  logp, ent, _, _ = fwd_call(cfg, logits, ids)
  return logp, ent


def _vjp_fwd(cfg, logits, ids):
  logp, ent, lse_rel, shift = fwd_call(cfg, logits, ids)
  return (logp, ent), (logits, ids, lse_rel, shift)


def _vjp_bwd(cfg, res, cts):
  logits, ids, lse_rel, shift = res
  ct_logp, _ = cts  # the entropy carries no gradient
  # A zero cotangent (a masked token) gives exactly 0 in the kernel, even where its logits are NaN.
  g = ct_logp * (1.0 / cfg.temperature)
  return bwd_call(cfg, logits, ids, lse_rel, shift, g), None


token_logps.defvjp(_vjp_fwd, _vjp_bwd)


# --------------------------------------------------------------- building blocks for other ops
def row_stats(cfg: LossConfig, logits, ids):
  """(lse, logp, entropy) per row of [N, V] logits (scaled by 1 / temperature), from the forward kernel.

  logp is NaN where the id is outside [0, V) (the fused LM-head loss uses this to find which vocabulary
  shard holds a token).
  """
  logp, entropy, lse_rel, shift = fwd_call(cfg, logits, ids)
  return shift + lse_rel, logp, entropy


def softmax_grad(cfg: LossConfig, logits, ids, lse, g):
  """g[n] * (onehot(id_n) - exp(z[n] - lse[n])) with z = logits / temperature, from the backward kernel."""
  return bwd_call(cfg, logits, ids, lse, jnp.zeros_like(lse), g)


def train_fwd(cfg: TrainConfig, x, ids, tok):
  """(logp, entropy, lse_rel, shift [N] f32, dlogits [N, V] in x's dtype) for the loss's cotangent 1.

  x: [N, V] logits; ids: [N] int32; tok: [N, len(cfg.fields)] f32, the per-token inputs.
  """
  return _family(cfg.loss.target).train_fwd(cfg, x, ids, tok)
