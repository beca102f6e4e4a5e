"""Tunix drop-in: the suite's loss kernels as tunix policy losses (tunix 0.1.7).

    from kernels.integrations import tunix as grpo_tunix
    grpo_tunix.register()                      # once, before building the learner
    GRPOConfig(..., policy_loss_fn="grpo_kernels_fused")   # GRPO, agentic GRPO ("grpo_kernels")
    PPOConfig(..., policy_loss_fn="ppo_kernels_fused")     # PPO with a critic ("ppo_kernels")

``"grpo_kernels"`` / ``"ppo_kernels"``: tunix's forward (f32 [B, T, V] logits from the model), then
:func:`kernels.grpo_loss` — the kernel's training path writes dlogits in its forward, no f32 softmax /
log-softmax copies. ``"grpo_kernels_fused"`` / ``"ppo_kernels_fused"``: the model's final-norm hidden
states and LM head weight into :func:`kernels.fused_linear_grpo_loss`; the [B, T, V] logits never
exist (Qwen2, Qwen3, Llama3, tied or untied heads; PPO's entropy bonus included, :mod:`.entropy`).
All take tunix's signature ``fn(model, train_example, algo_config, pad_id, eos_id, **kwargs) ->
(loss, aux)``, compute tunix's loss (``grpo_loss_fn`` / ``ppo_policy_loss_fn``) for every option of
its config (:mod:`.options`, :mod:`.ppo_options`: the mappings and the refused keys) and return
tunix's aux keys (:mod:`.metrics`). Tunix main returns ``LossOutput`` (weighted metrics) instead of
a tuple and adds ``skip_lm_head``: the hidden-state path uses ``skip_lm_head`` where the model has
it; the return type follows 0.1.7.
"""

from __future__ import annotations

try:
  from tunix.rl import function_registry
except ImportError as e:  # pragma: no cover - exercised only without the extra
  raise ImportError(
    'kernels.integrations.tunix needs tunix: pip install "grpo-kernels[tunix]"'
  ) from e

import kernels
from kernels import checks
from kernels.fused_linear import IMPLS as FUSED_IMPLS
from kernels.grpo_loss import IMPLS
from kernels.integrations.tunix import model as _model
from kernels.integrations.tunix.metrics import tunix_metrics
from kernels.integrations.tunix.options import (
  loss_from_config,
  row_scale,
  weighted_advantages,
)
from kernels.integrations.tunix.ppo import ppo_policy_loss

__all__ = ["GRPO_NAMES", "NAMES", "PPO_NAMES", "policy_loss", "ppo_policy_loss", "register"]

GRPO_NAMES = ("grpo_kernels", "grpo_kernels_fused")  # GRPOConfig (also the agentic learner's)
PPO_NAMES = ("ppo_kernels", "ppo_kernels_fused")  # PPOConfig
NAMES = GRPO_NAMES + PPO_NAMES


def register(*, impl: str = "auto", fused_impl: str = "auto", chunk_size: int | None = None):
  """Register ``"grpo_kernels"``, ``"grpo_kernels_fused"``, ``"ppo_kernels"`` and
  ``"ppo_kernels_fused"`` as tunix policy losses.

  impl / fused_impl: the ``impl`` of :func:`kernels.grpo_loss` / :func:`kernels.fused_linear_grpo_loss`
  ("auto": the kernel on TPU / GPU, the XLA reference on CPU, where the Pallas interpreter is a
  correctness tool; the fused "auto" is "chunked" on TPU / GPU). chunk_size: tokens per chunk of
  the fused "chunked" impl and of the fused PPO entropy bonus (default: their heuristics).
  Registering again replaces all four.
  """
  checks.choice("impl", impl, IMPLS)
  checks.choice("fused_impl", fused_impl, FUSED_IMPLS)
  checks.positive_int("chunk_size", chunk_size, allow_none=True)
  for names, loss in ((GRPO_NAMES, policy_loss), (PPO_NAMES, ppo_policy_loss)):
    for name, fused, which in ((names[0], False, impl), (names[1], True, fused_impl)):
      fn = _bound(loss, name, fused=fused, impl=which, chunk_size=chunk_size)
      function_registry.register_policy_loss_fn(name)(fn)


def _bound(loss, name: str, **options):
  """``loss`` with its options fixed, as a plain function of tunix's five arguments: the learners
  call it through ``nnx.value_and_grad`` with keyword arguments, which flax resolves to positions
  from the signature (a ``functools.partial`` has none it can use)."""

  def fn(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    return loss(model, train_example, algo_config, pad_id, eos_id, **options, **kwargs)

  fn.__name__ = fn.__qualname__ = name
  fn.__doc__ = loss.__doc__
  return fn


def policy_loss(
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
  """Tunix's GRPO policy loss (``algo_core.grpo_loss_fn``'s value, gradients and aux) computed by
  the loss kernels; ``fused`` picks the LM-head-fused loss on hidden states. Returns (loss, aux)."""
  del kwargs  # tunix passes nothing else to grpo_loss_fn today
  ex = train_example
  if fused:
    hidden, scored = _model.hidden_states(model, ex, pad_id, eos_id)
    source = (hidden, _model.lm_head(model, hidden.dtype))
  else:
    logits, scored = _model.logits(model, ex, pad_id, eos_id)
    source = (logits,)
  data = _model.example_rows(ex, scored)
  row_length = ex.completion_ids.shape[1]  # tunix's per-token arrays span the packed buffer too
  loss_cfg = loss_from_config(algo_config, row_length=row_length, has_ref=data["ref"] is not None)
  mask = data["mask"] != 0
  adv = weighted_advantages(data["advantages"], data["weights"], mask.shape)
  call = dict(
    old_logps=data["old"],
    ref_logps=data["ref"] if loss_cfg.spec.beta != 0.0 else None,
    spec=loss_cfg.spec,
    impl=impl,
    loss_scale=row_scale(mask) if loss_cfg.per_row else None,
  )
  if fused:
    loss, aux = kernels.fused_linear_grpo_loss(*source, scored.ids, mask, adv, chunk_size=chunk_size, **call)  # fmt: skip
  else:
    loss, aux = kernels.grpo_loss(*source, scored.ids, mask, adv, **call)
  metrics = tunix_metrics(
    _model.unpack(aux.per_token_logps, scored),
    _model.unpack(aux.entropy, scored),
    ex.completion_mask,
    ex.advantages,
    ex.old_per_token_logps,
    ex.ref_per_token_logps,
    getattr(ex, "sampler_is_weights", None),
    algo_config,
  )
  return loss, metrics
