"""``grpo_loss``: the GRPO policy loss from logits, as a Pallas kernel beside its pure-JAX reference."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import autotune, backend, checks, loss_spec
from kernels.grpo_loss import mosaic_gpu as _mosaic_gpu
from kernels.grpo_loss import pallas as _pallas
from kernels.grpo_loss import train as _train
from kernels.grpo_loss import vjp as _vjp
from kernels.grpo_loss.blocks import LossBlocks, default_blocks
from kernels.grpo_loss.reference import (
  GRPOAux,
  grpo_loss_reference,
  make_aux,
  objective_and_loss,
  token_logps_and_entropy,
)
from kernels.loss_spec import DEFAULT_MAX_LOG_RATIO, LOSS_TYPES, UNSET, LossSpec
from kernels.objective import policy_objective

__all__ = [
  "DEFAULT_MAX_LOG_RATIO",
  "LOSS_TYPES",
  "GRPOAux",
  "LossBlocks",
  "LossSpec",
  "default_blocks",
  "grpo_loss",
  "grpo_loss_reference",
  "token_logps_and_entropy",
]

IMPLS = ("auto", "pallas", "xla", "mosaic_gpu")


def grpo_loss(
  logits,  # [B, T, V] bf16/f32; logits[b, t] scores completion_ids[b, t] (already shifted)
  completion_ids,  # [B, T] int
  completion_mask,  # [B, T] 0/1 (bool, int or float)
  advantages,  # [B] or [B, T] f32 (an array or a Python list)
  *,
  old_logps=None,  # [B, T] f32 or None (on-policy)
  ref_logps=None,  # [B, T] f32, required when beta != 0
  sampler_logps=None,  # [B, T] f32: the rollout engine's log-probs of the sampled tokens
  spec: LossSpec | None = None,
  num_items_in_batch=None,  # scalar (may be traced), dapo's global token count
  impl: str = "auto",
  platform: backend.Platform | None = None,
  interpret: bool | None = None,
  blocks: LossBlocks | None = None,
  reuse_logits_buffer: bool = False,
  loss_scale=None,  # scalar (may be traced) or None: the returned loss is loss * loss_scale
  # LossSpec fields as keywords (a convenience: they build the spec; with spec= they must agree)
  loss_type: str = UNSET,
  epsilon_low: float = UNSET,
  epsilon_high: float = UNSET,
  beta: float = UNSET,
  temperature: float = UNSET,
  max_log_ratio: float | None = UNSET,
  is_mode: str | None = UNSET,
  is_cap: float = UNSET,
  importance_sampling_level: str = UNSET,
  epsilon_c: float | None = UNSET,
  max_completion_length: int | None = UNSET,
) -> tuple[jax.Array, GRPOAux]:
  """GRPO clipped-surrogate loss (TRL / Liger semantics), differentiable w.r.t. ``logits``.

  The loss is described by a :class:`kernels.LossSpec` (``spec=``, or its fields as keywords; the
  defaults are ``LossSpec()``'s). Per token, in float32 whatever the logits dtype (``M =
  max_log_ratio``; the options' full formulas: :func:`kernels.objective.policy_objective`)::

      logp      = log_softmax(logits / temperature)[completion_id]
      ratio     = exp(clamp(logp - old, -M, M))   # old = stop_gradient(logp) when old_logps is None
                                                   # GSPO: the sequence's masked-mean log-ratio
      per_token = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
      per_token = min(per_token, epsilon_c * |A|) where A < 0      # dual clip, when epsilon_c is set
      per_token *= stop_gradient(w)     # importance weight of the sampler's log-probs, when is_mode is set
      d         = clamp(ref - logp, -M, M)
      per_token += beta * (exp(d) - d - 1)         # k3 KL, only when beta != 0

  ``clamp`` has zero gradient at and beyond the bound (tunix's guard): a stale or mismatched sampler
  (``old_logps`` 100 nats off) or a -inf chosen logit gives a finite loss and gradient instead of inf
  / NaN. Below the bound the result is bit for bit the unclamped formula; ``max_log_ratio=None``
  disables the clamp.

  Reduction over masked tokens (an all-masked row contributes nothing and never makes a NaN):

      grpo:    mean_b( sum_t(per_token * mask) / max(sum_t mask, 1) )
      bnpo:    sum(per_token * mask) / max(sum(mask), 1)
      dr_grpo: sum(per_token * mask) / (B * max_completion_length)       # default T
      dapo:    sum(per_token * mask) / num_items_in_batch                # default max(sum(mask), 1)

  Masked positions are ignored entirely: their ids may be anything (e.g. -100 padding), their logits,
  advantages (when [B, T]), ``old_logps``, ``ref_logps`` and ``sampler_logps`` may be NaN / inf, and
  none of it reaches the loss or any gradient; every ``aux`` field is 0 / False there. Gradients flow
  into ``logits`` only (the other arrays are data), also through ``aux.per_token_logps`` and
  ``aux.per_token_kl``; the other aux fields carry none. -inf logits (a top-k / top-p mask) are fine
  anywhere: the entropy uses 0 * log 0 = 0. NaN or +inf logits at an unmasked position are a model
  failure and give NaN (every impl), like a NaN logp.

  Bad input: a ValueError (a TypeError too, for a wrong type or dtype: see
  :class:`kernels.checks.ArgumentTypeError`) that names the argument and its allowed range, raised
  before anything compiles. Values are checked where they are concrete; under ``jax.jit`` an unmasked
  id outside [0, V), a NaN / inf advantage and a traced ``num_items_in_batch <= 0`` give a NaN loss
  instead (never a finite wrong number), in every impl.

  Args:
    sampler_logps: the rollout engine's log-probs; reported as ``aux.sampler_log_ratio`` and used by
      ``is_mode`` (which requires them).
    spec: the loss; its fields may be given as keywords instead.
    impl: ``"pallas"`` runs the kernel (in the Pallas interpreter on CPU), ``"xla"`` the reference,
      ``"mosaic_gpu"`` the Hopper kernel, ``"auto"`` the kernel on TPU / GPU and the reference on CPU
      (the interpreter is a correctness tool, not a fast path).
    platform, interpret: the kernel target (default: :func:`kernels.backend.use_target`, else the
      host's backend). Set ``platform="tpu"`` on a CPU host to lower the Mosaic kernel ahead of time.
    blocks: tile sizes; default from :func:`default_blocks`.
    reuse_logits_buffer: alias dlogits onto the logits buffer (the kernel that writes dlogits), so
      that a donated logits array is overwritten in place instead of allocating a second [N, V] array.
    loss_scale: multiplies the loss (e.g. a micro-batch's share of the global loss). Passed here
      rather than multiplied afterwards, the kernels fold it into each token's loss weight, so the
      training path's backward sees cotangent 1 and makes no pass over [N, V] (see
      :mod:`kernels.grpo_loss.vjp`). aux is not scaled.

  Returns:
    ``(loss, aux)``: a scalar f32 loss and :class:`GRPOAux`.

  Raises:
    ValueError: see :func:`validate_loss_args` for the full list.
  """
  checks.choice("impl", impl, IMPLS)
  spec = loss_spec.resolve(spec, loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, temperature=temperature, max_log_ratio=max_log_ratio, is_mode=is_mode, is_cap=is_cap, importance_sampling_level=importance_sampling_level, epsilon_c=epsilon_c, max_completion_length=max_completion_length)  # fmt: skip
  args = validate_loss_args(
    checks.as_array("logits", logits),
    completion_ids,
    completion_mask,
    advantages,
    old_logps=old_logps,
    ref_logps=ref_logps,
    sampler_logps=sampler_logps,
    spec=spec,
    num_items_in_batch=num_items_in_batch,
  )
  logits, mask, ids = args.logits, args.mask, args.ids
  target = backend.resolve(platform, interpret)
  impl, blocks = autotune.resolve("grpo_loss", impl, blocks, target, dict(dtype=jnp.dtype(logits.dtype).name, tokens=logits.shape[0] * logits.shape[1], vocab=logits.shape[2]))  # fmt: skip
  if loss_scale is not None:
    loss_scale = checks.as_array("loss_scale", loss_scale)
    if loss_scale.ndim != 0 or not jnp.issubdtype(loss_scale.dtype, jnp.number):
      raise checks.ArgumentTypeError(f"loss_scale must be a numeric scalar, got {loss_scale.dtype}{list(loss_scale.shape)}")  # fmt: skip
    checks.finite("loss_scale", loss_scale)
    loss_scale = jax.lax.stop_gradient(loss_scale.astype(jnp.float32))
  if impl == "xla" or (impl == "auto" and target.platform == "cpu"):
    loss, aux = grpo_loss_reference(
      logits,
      ids,
      mask,
      args.advantages,
      old_logps=args.old_logps,
      ref_logps=args.ref_logps,
      sampler_logps=args.sampler_logps,
      spec=spec,
      num_items_in_batch=num_items_in_batch,
    )
    return (loss if loss_scale is None else loss * loss_scale), aux

  b, t, v = logits.shape
  n = b * t
  x, flat_ids = logits.reshape(n, v), ids.reshape(n)
  if impl == "mosaic_gpu":  # the Mosaic GPU kernel (Hopper); impl="pallas" is Triton on GPU
    kernel_cfg = _mosaic_gpu.make_config(x, target=target, blocks=blocks, temperature=spec.temperature, reuse_logits_buffer=reuse_logits_buffer)  # fmt: skip
  else:
    blocks = default_blocks(target, n, v) if blocks is None else blocks
    blocks.check(target, n, v)
    kernel_cfg = _pallas.LossConfig(target, blocks, v, spec.temperature, reuse_logits_buffer)
  data = dict(
    mask=mask,
    advantages=args.advantages,
    old_logps=args.old_logps,
    ref_logps=args.ref_logps,
    sampler_logps=args.sampler_logps,
    num_items_in_batch=num_items_in_batch,
    scale=loss_scale,
  )
  if not spec.sequence_level:  # the two-pass training path (kernels.grpo_loss.vjp)
    present = tuple(k for k in _train.TOKEN_FIELDS[3:] if data[k] is not None)
    fields = _train.TOKEN_FIELDS[:3] + present
    kernel_cfg = _train.TrainConfig(kernel_cfg, spec, fields)
    loss, logp, entropy = _vjp.loss_logps(_vjp.Static(kernel_cfg, b, t), x, flat_ids, data)
    logps = {k: data[k] for k in ("old_logps", "ref_logps", "sampler_logps")}
    obj = policy_objective(logp.reshape(b, t), mask, args.advantages, spec, **logps)
    return loss, make_aux(mask, logp.reshape(b, t), entropy.reshape(b, t), obj)
  # sequence-level: statistics forward, the [B, T] objective, the backward kernel (three passes)
  if impl == "mosaic_gpu":
    logp, entropy = _mosaic_gpu.token_logps_cfg(kernel_cfg, x, flat_ids)
  else:
    logp, entropy = _pallas.token_logps(kernel_cfg, x, flat_ids)
  loss, aux = objective_and_loss(
    logp.reshape(b, t),
    entropy.reshape(b, t),
    mask,
    args.advantages,
    spec,
    num_items_in_batch=num_items_in_batch,
    old_logps=args.old_logps,
    ref_logps=args.ref_logps,
    sampler_logps=args.sampler_logps,
  )
  return (loss if loss_scale is None else loss * loss_scale), aux


class LossArgs(NamedTuple):
  """Validated loss inputs, as every impl consumes them."""

  logits: jax.Array  # [B, T, V] (a ShapeDtypeStruct for the fused LM-head loss)
  mask: jax.Array  # [B, T] bool
  ids: jax.Array  # [B, T] int32, 0 at masked positions
  advantages: jax.Array  # [B, T] f32, stop_gradient, 0 at masked positions
  old_logps: jax.Array | None  # [B, T] f32, stop_gradient, 0 at masked positions
  ref_logps: jax.Array | None  # [B, T] f32, same
  sampler_logps: jax.Array | None  # [B, T] f32, same


def validate_loss_args(
  logits,  # [B, T, V] array, or a ShapeDtypeStruct of it
  completion_ids,  # [B, T]
  completion_mask,  # [B, T]
  advantages,  # [B] or [B, T]
  *,
  old_logps,  # [B, T] or None
  ref_logps,  # [B, T] or None
  sampler_logps,  # [B, T] or None
  spec: LossSpec,
  num_items_in_batch,
) -> LossArgs:
  """The one check of the policy-loss arguments (``grpo_loss`` and ``fused_linear_grpo_loss``).

  The settings were checked by :class:`kernels.LossSpec` (``loss_type``, ``beta`` >= 0,
  ``epsilon_low`` in [0, 1), ``epsilon_high`` >= 0, ``temperature`` > 0, ``max_log_ratio`` > 0,
  ``is_mode`` / ``importance_sampling_level`` names, ``is_cap`` > 0, ``epsilon_c`` > 1,
  ``max_completion_length`` a positive int). Here: ValueError (ArgumentTypeError, also a TypeError,
  for types / dtypes) for logits not a floating [B, T, V] array with V >= 1; ids / mask / advantages
  ([B] or [B, T]) / old / ref / sampler shapes that do not match it; non-integer ids;
  ``ref_logps`` missing with beta != 0; ``sampler_logps`` missing with ``is_mode`` set; and, where the
  values are concrete: ids outside [0, V) at unmasked positions, NaN / inf advantages (at unmasked
  positions, when [B, T]), NaN / +inf ``old_logps`` / ``ref_logps`` at unmasked positions (-inf is
  legal: the clamp bounds it), NaN / inf ``sampler_logps`` at unmasked positions (the sampled token
  had positive probability), ``num_items_in_batch`` <= 0 or non-finite.

  Returns the inputs as jax arrays (Python lists accepted), with masked positions zeroed so that
  nothing non-finite there reaches any arithmetic, and [B] advantages broadcast to [B, T].
  """
  if not isinstance(spec, LossSpec):
    raise checks.ArgumentTypeError(f"spec must be a kernels.LossSpec, got {type(spec).__name__}")
  checks.ndim_array("logits", logits, 3, "[B, T, V]")
  checks.dtype_kind("logits", logits, "floating")
  b, t, v = logits.shape
  if v < 1:
    raise ValueError("logits has an empty vocabulary axis (V = 0)")
  ids = checks.as_array("completion_ids", completion_ids)
  mask = checks.as_array("completion_mask", completion_mask)
  adv = checks.as_array("advantages", advantages)
  old = checks.as_array("old_logps", old_logps)
  ref = checks.as_array("ref_logps", ref_logps)
  sampler = checks.as_array("sampler_logps", sampler_logps)
  context = f" to match logits {tuple(logits.shape)}"
  if adv is not None and jnp.ndim(adv) == 2:
    checks.shape("advantages", adv, (b, t), f" (per token) or ({b},){context}")
  else:
    checks.shape("advantages", adv, (b,), f" (per sequence) or ({b}, {t}){context}")
  for name, arr, shape in (
    ("completion_ids", ids, (b, t)),
    ("completion_mask", mask, (b, t)),
    ("old_logps", old, (b, t)),
    ("ref_logps", ref, (b, t)),
    ("sampler_logps", sampler, (b, t)),
  ):
    checks.shape(name, arr, shape, context)
  checks.dtype_kind("completion_ids", ids, "integer")
  for name, arr in (
    ("advantages", adv),
    ("old_logps", old),
    ("ref_logps", ref),
    ("sampler_logps", sampler),
  ):
    if arr is not None and not jnp.issubdtype(arr.dtype, jnp.number):
      raise checks.ArgumentTypeError(f"{name} must be numeric, got {arr.dtype}")
  if spec.beta != 0.0 and ref is None:
    raise ValueError("ref_logps is required when beta != 0")
  if spec.is_mode is not None and sampler is None:
    raise ValueError(
      f"is_mode={spec.is_mode!r} needs sampler_logps (the rollout engine's log-probs, [B, T])"
    )
  checks.positive_count("num_items_in_batch", num_items_in_batch)
  mask = mask if mask.dtype == jnp.bool_ else mask != 0
  checks.index_range("completion_ids", ids, v, where=mask, qualifier="unmasked")
  checks.finite("advantages", adv, where=mask if adv.ndim == 2 else None)
  checks.finite("old_logps", old, where=mask, allow_neg_inf=True)
  checks.finite("ref_logps", ref, where=mask, allow_neg_inf=True)
  checks.finite("sampler_logps", sampler, where=mask)
  # Zero at masked positions: their values (padding ids, stale NaN log-probs) never reach arithmetic.
  keep = lambda a: (
    None if a is None else jnp.where(mask, jax.lax.stop_gradient(a), 0).astype(jnp.float32)
  )
  adv = adv.astype(jnp.float32)
  return LossArgs(
    logits=logits,
    mask=mask,
    ids=jnp.where(mask, ids.astype(jnp.int32), 0),
    advantages=keep(adv if adv.ndim == 2 else jnp.broadcast_to(adv[:, None], (b, t))),
    old_logps=keep(old),
    ref_logps=keep(ref),
    sampler_logps=keep(sampler),
  )
