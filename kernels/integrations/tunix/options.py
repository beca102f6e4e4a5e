"""Tunix's GRPO loss options as a :class:`kernels.LossSpec` plus the inputs that carry the rest.

Pure: reads the config's attributes and builds arrays; nothing here imports tunix, so the mapping is
testable without it. Tunix's ``grpo_loss_fn`` (0.1.7, ``tunix/rl/algo_core.py``) per token::

    r = clip(logp - old, -20, 20)                       (gspo-token: the masked mean of r, as a value,
                                                         plus logp - sg(logp); then clip(max=10))
    per_token = max(-A e^r, -A clip(e^r, 1 - epsilon, 1 + epsilon_high));  dual clip where A < 0
    per_token *= sampler_is_weights                      (when present)
    loss = aggregate(per_token) + beta * aggregate(kl(logp, ref))   (kl only when ref is present)

and every option has an exact counterpart here:

* ``loss_agg_mode``: "token-mean" -> ``bnpo``; "sequence-mean-token-mean" -> ``grpo``;
  "sequence-mean-token-scale" -> ``dr_grpo`` over the row length; "seq-mean-token-sum" and
  "sequence-mean-token-sum-norm" -> ``dr_grpo`` with ``max_completion_length=1`` (a row's token
  sum). Tunix divides the sequence-mean modes by the number of non-empty rows, ours by B: the
  ``row_scale`` B / max(non-empty rows, 1) is passed as ``loss_scale`` (folded into the kernels'
  token weights, so the training path's backward stays one pass).
* ``loss_algo`` "gspo-token" -> ``importance_sampling_level="sequence_token"``, cap 10.
* ``kl_loss_mode`` "kl" / "low_var_kl" / "mse_kl" -> ``kl_estimator`` "k1" / "k3" / "k2".
* ``sampler_is_weights`` w >= 0 multiply the policy term: folded into per-token advantages A * w,
  exact because max(-A r, -A c) and the dual clip's min(-c A, .) are positively homogeneous in A.
* ``temperature`` 0 or 1 -> no division (tunix divides only otherwise).

Not mappable (ValueError naming the key): ``kl_clamp_value`` (a clamp of the KL value itself).
Tunix clamps only the importance log-ratio at +-20; ``LossSpec`` also clamps the KL's ref - logp at
+-20 — the two differ only where |ref - logp| >= 20 nats, where tunix's k3 overflows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels import checks
from kernels.loss_spec import LossSpec

AGG_MODES = {  # tunix loss_agg_mode -> (loss_type, divisor per row: "T" or 1, divided by rows)
  "token-mean": ("bnpo", None, False),
  "sequence-mean-token-mean": ("grpo", None, True),
  "sequence-mean-token-scale": ("dr_grpo", "T", True),
  "seq-mean-token-sum": ("dr_grpo", 1, True),
  "sequence-mean-token-sum-norm": ("dr_grpo", 1, True),
}
KL_MODES = {"kl": "k1", "low_var_kl": "k3", "mse_kl": "k2"}
LOSS_ALGOS = ("grpo", "gspo-token")
GSPO_TOKEN_CAP = 10.0  # tunix's clip(max=10.0) of gspo-token's log-ratio


@dataclasses.dataclass(frozen=True)
class TunixLoss:
  """The spec of one tunix config and whether the loss is rescaled to tunix's non-empty rows."""

  spec: LossSpec
  per_row: bool  # multiply by B / max(non-empty rows, 1)


def _choice(key: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(
      f"GRPOConfig.{key}={value!r} is not supported; expected one of {tuple(allowed)}"
    )


def loss_from_config(algo_config, *, row_length: int, has_ref: bool) -> TunixLoss:
  """The LossSpec equivalent of tunix's ``grpo_loss_fn`` under ``algo_config``.

  row_length: the length of the rows tunix aggregates over (the completion length; the packed
  buffer's length with packing), ``sequence-mean-token-scale``'s divisor. has_ref: whether the
  example carries ``ref_per_token_logps`` (tunix adds the KL term only then).
  Raises ValueError naming the tunix key for an option that cannot map or a value LossSpec rejects.
  """
  mode = getattr(algo_config, "loss_agg_mode", "sequence-mean-token-mean")
  _choice("loss_agg_mode", mode, AGG_MODES)
  algo = getattr(algo_config, "loss_algo", "grpo")
  _choice("loss_algo", algo, LOSS_ALGOS)
  kl_mode = getattr(algo_config, "kl_loss_mode", "kl")
  _choice("kl_loss_mode", kl_mode, KL_MODES)
  if getattr(algo_config, "kl_clamp_value", None) is not None:
    raise ValueError(
      "GRPOConfig.kl_clamp_value is not supported by the grpo_kernels losses (a clamp of the KL "
      "value; LossSpec clamps ref - logp at +-max_log_ratio instead): set it to None"
    )
  loss_type, per_row_len, per_row = AGG_MODES[mode]
  epsilon = getattr(algo_config, "epsilon", 0.2)
  beta = getattr(algo_config, "beta", 0.0)
  temperature = getattr(algo_config, "temperature", 1.0)
  fields = dict(
    loss_type=loss_type,
    max_completion_length=row_length if per_row_len == "T" else per_row_len,
    epsilon_low=("epsilon", epsilon),
    epsilon_high=("epsilon_high", getattr(algo_config, "epsilon_high", epsilon)),
    epsilon_c=("epsilon_c", getattr(algo_config, "epsilon_c", None)),
    beta=("beta", 0.0 if (beta is None or not has_ref) else beta),
    temperature=("temperature", 1.0 if temperature in (0.0, 1.0) else temperature),
    kl_estimator=KL_MODES[kl_mode],
  )
  if algo == "gspo-token":
    fields.update(importance_sampling_level="sequence_token", sequence_log_ratio_cap=GSPO_TOKEN_CAP)
  return TunixLoss(spec_from_fields(fields, "GRPOConfig"), per_row)


def spec_from_fields(fields: dict, config: str) -> LossSpec:
  """LossSpec(**fields); a field given as (config key, value) is named in LossSpec's ValueError as
  ``{config}.{key}={value!r}``."""
  keys = {k: v[0] for k, v in fields.items() if isinstance(v, tuple)}
  values = {k: (v[1] if isinstance(v, tuple) else v) for k, v in fields.items()}
  try:
    return LossSpec(**values)
  except ValueError as e:
    field = next((k for k in keys if str(e).startswith(k)), None)
    where = f"{config}.{keys[field]}={values[field]!r}" if field else config
    raise ValueError(f"{where}: {e}") from e


def row_scale(mask):  # [B, T] bool -> scalar f32
  """B / max(rows with an unmasked token, 1): turns our mean over B rows into tunix's mean over the
  non-empty ones (traced; a batch of empty rows has loss 0 either way)."""
  rows = jnp.sum(jnp.any(mask, axis=-1)).astype(jnp.float32)
  return jnp.float32(mask.shape[0]) / jnp.maximum(rows, 1.0)


def weighted_advantages(
  advantages,  # [B] or [B, T]
  weights,  # [B, T] or None: tunix's sampler_is_weights (>= 0, detached)
  shape: tuple[int, int],
):  # -> [B] or [B, T] f32
  """Advantages with tunix's precomputed importance weights folded in: A * w per token.

  Exact for w >= 0 (the clipped surrogate and the dual clip are positively homogeneous in A).
  Concrete negative weights are a ValueError; traced ones cannot be checked (tunix's weights are
  truncated importance ratios, >= 0 by construction).
  """
  adv = jnp.asarray(advantages, jnp.float32)
  if weights is None:
    return adv
  if tuple(np.shape(weights)) != tuple(shape):
    raise ValueError(f"sampler_is_weights must have shape {tuple(shape)}, got {np.shape(weights)}")
  # checked with numpy on the values as given: jnp ops inside a jit trace give tracers even of
  # constants; traced weights pass unchecked
  if checks.is_concrete(weights) and bool(np.any(np.asarray(weights) < 0)):
    raise ValueError("sampler_is_weights must be >= 0 (importance weights)")
  w = jnp.asarray(weights, jnp.float32)
  adv = adv if adv.ndim == 2 else jnp.broadcast_to(adv[:, None], shape)
  return adv * jax.lax.stop_gradient(w)
