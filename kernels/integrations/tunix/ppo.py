"""Tunix's PPO policy loss (``algo_core.ppo_policy_loss_fn``, 0.1.7) computed by the loss kernels.

``"ppo_kernels"``: tunix's forward (the f32 [B, T, V] logits), then :func:`kernels.grpo_loss`.
``"ppo_kernels_fused"``: the final-norm hidden states and the LM head into
:func:`kernels.fused_linear_grpo_loss`, and the entropy bonus (when ``entropy_coef`` is set) by
:func:`.entropy.from_hidden` one token chunk at a time: the [B, T, V] logits never exist. The
option mapping (and the one refused key): :mod:`.ppo_options`; the aux keys: :func:`.metrics.ppo_metrics`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from tunix.rl import algo_core

import kernels
from kernels.integrations.tunix import entropy as _entropy
from kernels.integrations.tunix import model as _model
from kernels.integrations.tunix.metrics import ppo_metrics
from kernels.integrations.tunix.ppo_options import ppo_loss_from_config


def ppo_policy_loss(
  model,
  train_example,
  algo_config,
  pad_id: int,
  eos_id: int,
  *,
  fused: bool = True,
  impl: str = "auto",
  chunk_size: int | None = None,
  **kwargs,
):
  """Tunix's PPO policy loss (``ppo_policy_loss_fn``'s value, gradients and aux) computed by the
  loss kernels; ``fused`` picks the LM-head-fused loss on hidden states. Returns (loss, aux)."""
  del kwargs  # tunix passes nothing else to ppo_policy_loss_fn today
  ex = train_example
  cfg = ppo_loss_from_config(algo_config, has_ref=ex.ref_per_token_logps is not None)
  _check_advantages(ex)
  if fused:
    hidden, scored = _model.hidden_states(model, ex, pad_id, eos_id)
    head = _model.lm_head(model, hidden.dtype)
  else:
    logits, scored = _model.logits(model, ex, pad_id, eos_id)
  data = _model.example_rows(ex, scored)
  mask = data["mask"] != 0
  call = dict(
    old_logps=data["old"], ref_logps=data["ref"] if cfg.kl else None, spec=cfg.spec, impl=impl
  )
  if fused:
    loss, aux = kernels.fused_linear_grpo_loss(hidden, head, scored.ids, mask, data["advantages"], chunk_size=chunk_size, **call)  # fmt: skip
  else:
    loss, aux = kernels.grpo_loss(logits, scored.ids, mask, data["advantages"], **call)
  metrics = ppo_metrics(
    _model.unpack(aux.per_token_logps, scored),
    ex.completion_mask,
    ex.advantages,
    ex.old_per_token_logps,
    ex.ref_per_token_logps,
    cfg.spec,
    cfg.kl,
  )
  if cfg.entropy_coef != 0.0:
    if fused:  # rows the loss skips never reach the head (they may hold anything)
      hidden = jnp.where(mask[..., None], hidden, jnp.zeros((), hidden.dtype))
      token_entropy = _entropy.from_hidden(hidden, head, chunk_size)
    else:
      token_entropy = _entropy.from_logits(logits)
    entropy_loss = algo_core.masked_mean(token_entropy, mask)
    loss = loss - cfg.entropy_coef * entropy_loss
    metrics["loss/entropy"] = jax.lax.stop_gradient(entropy_loss)
  return loss, metrics


def _check_advantages(ex) -> None:
  """Tunix's PPO loss multiplies [B, T] per-token (GAE) advantages into [B, T] ratios; a [B] array
  would broadcast along the wrong axis there, so it is refused here."""
  shape, want = jnp.shape(ex.advantages), jnp.shape(ex.completion_mask)
  if tuple(shape) != tuple(want):
    raise ValueError(
      f"ppo_kernels needs per-token advantages of completion_mask's shape {tuple(want)} (tunix's "
      f"PPO learner gives GAE advantages [B, T]), got {tuple(shape)}"
    )
