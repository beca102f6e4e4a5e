"""The one check of the policy-loss arguments, shared by ``grpo_loss`` and ``fused_linear_grpo_loss``.

The settings were checked by :class:`kernels.LossSpec` (``loss_type``, ``beta`` >= 0, ``epsilon_low``
in [0, 1), ``epsilon_high`` >= 0, ``temperature`` > 0, ``max_log_ratio`` > 0, ``is_mode`` /
``importance_sampling_level`` names, ``is_cap`` > 0, ``epsilon_c`` > 1, ``max_completion_length`` a
positive int). Here, one function per concern: the arrays' shapes, their dtypes, what the spec needs,
and — where the values are concrete — their values. Every failure is a ValueError naming the argument
(:class:`kernels.checks.ArgumentTypeError`, also a TypeError, for a wrong type or dtype), raised before
anything compiles.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import checks
from kernels.loss_spec import LossSpec

LOGPS = ("old_logps", "ref_logps", "sampler_logps")
DATA = (*LOGPS, "support_gap")  # the [B, T] f32 inputs beside ids, mask and advantages


class LossArgs(NamedTuple):
  """Validated loss inputs, as every impl consumes them."""

  logits: jax.Array  # [B, T, V] (a ShapeDtypeStruct for the fused LM-head loss)
  mask: jax.Array  # [B, T] bool
  ids: jax.Array  # [B, T] int32, 0 at masked positions
  advantages: jax.Array  # [B, T] f32, stop_gradient, 0 at masked positions
  old_logps: jax.Array | None  # [B, T] f32, stop_gradient, 0 at masked positions
  ref_logps: jax.Array | None  # [B, T] f32, same
  sampler_logps: jax.Array | None  # [B, T] f32, same
  support_gap: jax.Array | None  # [B, T] f32 <= 0 (-inf: unfiltered), same (kernels.support)


def validate_loss_args(
  logits,  # [B, T, V] array, or a ShapeDtypeStruct of it
  completion_ids,  # [B, T]
  completion_mask,  # [B, T]
  advantages,  # [B] or [B, T]
  *,
  old_logps,  # [B, T] or None
  ref_logps,  # [B, T] or None
  sampler_logps,  # [B, T] or None
  support_gap=None,  # [B, T] or None
  spec: LossSpec,
  num_items_in_batch,
) -> LossArgs:
  """ValueError for logits not a floating [B, T, V] array with V >= 1; ids / mask / advantages ([B]
  or [B, T]) / old / ref / sampler shapes that do not match it; non-integer ids; ``ref_logps``
  missing with beta != 0; ``sampler_logps`` missing with ``is_mode`` set; and, where the values are
  concrete: ids outside [0, V) at unmasked positions, NaN / inf advantages (at unmasked positions,
  when [B, T]), NaN / +inf ``old_logps`` / ``ref_logps`` at unmasked positions (-inf is legal: the
  clamp bounds it), NaN / inf ``sampler_logps`` at unmasked positions (the sampled token had
  positive probability), NaN or positive ``support_gap`` at unmasked positions (a gap is <= 0; -inf
  means nothing was filtered), ``num_items_in_batch`` <= 0 or non-finite.

  Returns the inputs as jax arrays (Python lists accepted), with masked positions zeroed so that
  nothing non-finite there reaches any arithmetic, and [B] advantages broadcast to [B, T].
  """
  if not isinstance(spec, LossSpec):
    raise checks.ArgumentTypeError(f"spec must be a kernels.LossSpec, got {type(spec).__name__}")
  checks.ndim_array("logits", logits, 3, "[B, T, V]")
  checks.dtype_kind("logits", logits, "floating")
  if logits.shape[2] < 1:
    raise ValueError("logits has an empty vocabulary axis (V = 0)")
  arrays = {
    "completion_ids": checks.as_array("completion_ids", completion_ids),
    "completion_mask": checks.as_array("completion_mask", completion_mask),
    "advantages": checks.as_array("advantages", advantages),
    "old_logps": checks.as_array("old_logps", old_logps),
    "ref_logps": checks.as_array("ref_logps", ref_logps),
    "sampler_logps": checks.as_array("sampler_logps", sampler_logps),
    "support_gap": checks.as_array("support_gap", support_gap),
  }
  _check_shapes(logits.shape, arrays)
  _check_dtypes(arrays)
  _check_spec_needs(spec, arrays)
  checks.positive_count("num_items_in_batch", num_items_in_batch)
  mask = arrays["completion_mask"]
  arrays["completion_mask"] = mask if mask.dtype == jnp.bool_ else mask != 0
  _check_values(logits.shape[2], arrays)
  return _zero_masked(logits, arrays)


def _check_shapes(logits_shape: tuple, arrays: dict) -> None:
  """Every array's shape against logits' [B, T, V] (advantages: [B] or [B, T])."""
  b, t, _ = logits_shape
  context = f" to match logits {tuple(logits_shape)}"
  adv = arrays["advantages"]
  if adv is not None and jnp.ndim(adv) == 2:
    checks.shape("advantages", adv, (b, t), f" (per token) or ({b},){context}")
  else:
    checks.shape("advantages", adv, (b,), f" (per sequence) or ({b}, {t}){context}")
  for name in ("completion_ids", "completion_mask", *DATA):
    checks.shape(name, arrays[name], (b, t), context)


def _check_dtypes(arrays: dict) -> None:
  checks.dtype_kind("completion_ids", arrays["completion_ids"], "integer")
  for name in ("advantages", *DATA):
    arr = arrays[name]
    if arr is not None and not jnp.issubdtype(arr.dtype, jnp.number):
      raise checks.ArgumentTypeError(f"{name} must be numeric, got {arr.dtype}")


def _check_spec_needs(spec: LossSpec, arrays: dict) -> None:
  """The arrays the spec's options read must be given."""
  if spec.beta != 0.0 and arrays["ref_logps"] is None:
    raise ValueError("ref_logps is required when beta != 0")
  if spec.is_mode is not None and arrays["sampler_logps"] is None:
    raise ValueError(
      f"is_mode={spec.is_mode!r} needs sampler_logps (the rollout engine's log-probs, [B, T])"
    )


def _check_values(vocab: int, arrays: dict) -> None:
  """Where the values are concrete (each check is a no-op on tracers): at unmasked positions only."""
  mask, adv = arrays["completion_mask"], arrays["advantages"]
  checks.index_range("completion_ids", arrays["completion_ids"], vocab, where=mask, qualifier="unmasked")  # fmt: skip
  checks.finite("advantages", adv, where=mask if adv.ndim == 2 else None)
  checks.finite("old_logps", arrays["old_logps"], where=mask, allow_neg_inf=True)
  checks.finite("ref_logps", arrays["ref_logps"], where=mask, allow_neg_inf=True)
  checks.finite("sampler_logps", arrays["sampler_logps"], where=mask)
  checks.real_array("support_gap", arrays["support_gap"], hi=0.0, where=mask, allow_neg_inf=True)


def _zero_masked(logits, arrays: dict) -> LossArgs:
  """Zero at masked positions: their values (padding ids, stale NaN log-probs) never reach
  arithmetic. [B] advantages are broadcast to [B, T]; data arrays carry no gradient."""
  b, t, _ = logits.shape
  mask, adv = arrays["completion_mask"], arrays["advantages"].astype(jnp.float32)
  keep = lambda a: (
    None if a is None else jnp.where(mask, jax.lax.stop_gradient(a), 0).astype(jnp.float32)
  )
  return LossArgs(
    logits=logits,
    mask=mask,
    ids=jnp.where(mask, arrays["completion_ids"].astype(jnp.int32), 0),
    advantages=keep(adv if adv.ndim == 2 else jnp.broadcast_to(adv[:, None], (b, t))),
    **{name: keep(arrays[name]) for name in DATA},
  )
