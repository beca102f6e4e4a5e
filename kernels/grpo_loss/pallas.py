"""The ``pallas`` impl of the GRPO loss: one entry over its two kernel families, chosen by the target.

  tiled   (TPU, CPU interpreter): :mod:`kernels.grpo_loss.pallas_tpu`
  rowloop (GPU / Triton):         :mod:`kernels.grpo_loss.pallas_triton`

Each family has the same three kernels: the statistics forward (per token row: an online max /
sum-exp over the vocabulary, the chosen token's logit and the entropy's running sum, finished into
(log p, entropy) and the saved log-sum-exp), the backward (dlogits = g / T * (onehot(id) - softmax(z))
tile by tile from the saved log-sum-exp) and the training-path forward that also writes dlogits.
With a support gap each kernel takes a per-row threshold (:func:`threshold`) and applies
:func:`kernels.support.gapped` to its scaled tiles in every sweep: no pre-masked copy of the logits.

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

from kernels import lse, support
from kernels.grpo_loss import pallas_tpu, pallas_triton
from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.grpo_loss.train import TrainConfig


def _family(target):
  """The kernel module of ``target``'s family."""
  return pallas_triton if target.family == "rowloop" else pallas_tpu


def fwd_call(cfg: LossConfig, x, ids, thr=None):
  """The statistics kernel: (logp, entropy, lse_rel, shift) [N] f32 of logits [N, V] and ids [N];
  thr: [N] f32 each row's support threshold (:func:`threshold`), or None: no gap, the kernel as
  without one (no extra input, no extra op)."""
  return _family(cfg.target).fwd(cfg, x, ids, thr)


def bwd_call(cfg: LossConfig, x, ids, lse_rel, shift, g, thr=None):
  """The backward kernel: dlogits [N, V] of (logits, ids, lse_rel, shift, g[, thr])."""
  return _family(cfg.target).bwd(cfg, x, ids, lse_rel, shift, g, thr)


def threshold(
  x,  # [N, V] logits
  ids,  # [N] int32
  gap,  # [N] f32 support gaps, or None
  temperature: float,
):  # -> [N] f32 or None
  """Each row's support threshold z'_y + g for the kernels' sweeps (:func:`kernels.support.threshold`),
  formed in XLA from one gather of N chosen logits scaled as every kernel scales its tiles (f32
  times 1 / T: :func:`kernels.lse.chosen_logit`), so a kernel's own z'_y is never below it (y stays
  in S; the kernels that compare columns with the id keep it by ``hit`` as well). None without gaps."""
  if gap is None:
    return None
  return support.threshold(lse.chosen_logit(x, ids, x.shape[1], temperature), gap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def token_logps(cfg: LossConfig, logits, ids, thr=None):
  """(logp, entropy) of flat tokens, [N] f32 each; differentiable w.r.t. logits through logp.

  logits: [N, V] bf16/f32; ids: [N] int32 (outside [0, V): logp NaN); thr: [N] f32 support
  thresholds or None (no gradient). The entropy carries no gradient.
  """
  logp, ent, _, _ = fwd_call(cfg, logits, ids, thr)
  return logp, ent


def _vjp_fwd(cfg, logits, ids, thr):
  logp, ent, lse_rel, shift = fwd_call(cfg, logits, ids, thr)
  return (logp, ent), (logits, ids, lse_rel, shift, thr)


def _vjp_bwd(cfg, res, cts):
  logits, ids, lse_rel, shift, thr = res
  ct_logp, _ = cts  # the entropy carries no gradient
  # A zero cotangent (a masked token) gives exactly 0 in the kernel, even where its logits are NaN.
  g = ct_logp * (1.0 / cfg.temperature)
  return bwd_call(cfg, logits, ids, lse_rel, shift, g, thr), None, None


token_logps.defvjp(_vjp_fwd, _vjp_bwd)


# --------------------------------------------------------------- building blocks for other ops
def row_stats(cfg: LossConfig, logits, ids, thr=None):
  """(lse, logp, entropy) per row of [N, V] logits (scaled by 1 / temperature), from the forward kernel.

  logp is NaN where the id is outside [0, V) (the fused LM-head loss uses this to find which vocabulary
  shard holds a token). thr: [N] f32 support thresholds (over S only), or None.
  """
  logp, entropy, lse_rel, shift = fwd_call(cfg, logits, ids, thr)
  return shift + lse_rel, logp, entropy


def softmax_grad(cfg: LossConfig, logits, ids, lse, g, thr=None):
  """g[n] * (onehot(id_n) - exp(z[n] - lse[n])) with z = logits / temperature, from the backward
  kernel; thr: [N] f32 support thresholds (0 outside S), or None."""
  return bwd_call(cfg, logits, ids, lse, jnp.zeros_like(lse), g, thr)


def train_fwd(cfg: TrainConfig, x, ids, tok, thr=None):
  """(logp, entropy, lse_rel, shift [N] f32, dlogits [N, V] in x's dtype) for the loss's cotangent 1.

  x: [N, V] logits; ids: [N] int32; tok: [N, len(cfg.fields)] f32, the per-token inputs; thr: [N]
  f32 support thresholds or None.
  """
  return _family(cfg.loss.target).train_fwd(cfg, x, ids, tok, thr)
