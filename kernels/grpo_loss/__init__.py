"""``grpo_loss``: the GRPO policy loss from logits, as a Pallas kernel beside its pure-JAX reference."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import autotune, backend, checks
from kernels.grpo_loss import mosaic_gpu as _mosaic_gpu
from kernels.grpo_loss import pallas as _pallas
from kernels.grpo_loss.blocks import LossBlocks, default_blocks
from kernels.grpo_loss.reference import (
  DEFAULT_MAX_LOG_RATIO,
  LOSS_TYPES,
  GRPOAux,
  grpo_loss_reference,
  make_aux,
  reduce_loss,
  token_logps_and_entropy,
)

__all__ = [
  "DEFAULT_MAX_LOG_RATIO",
  "LOSS_TYPES",
  "GRPOAux",
  "LossBlocks",
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
  advantages,  # [B] f32 (an array or a Python list)
  *,
  old_logps=None,  # [B, T] f32 or None (on-policy)
  ref_logps=None,  # [B, T] f32, required when beta != 0
  beta: float = 0.0,
  epsilon_low: float = 0.2,
  epsilon_high: float = 0.2,
  temperature: float = 1.0,
  loss_type: str = "grpo",
  max_completion_length: int | None = None,
  num_items_in_batch=None,  # scalar (may be traced), dapo's global token count
  max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO,
  impl: str = "auto",
  platform: backend.Platform | None = None,
  interpret: bool | None = None,
  blocks: LossBlocks | None = None,
  reuse_logits_buffer: bool = False,
) -> tuple[jax.Array, GRPOAux]:
  """GRPO clipped-surrogate loss (TRL / Liger semantics), differentiable w.r.t. ``logits``.

  Per token, in float32 whatever the logits dtype (``M = max_log_ratio``)::

      logp      = log_softmax(logits / temperature)[completion_id]
      ratio     = exp(clamp(logp - old, -M, M))   # old = stop_gradient(logp) when old_logps is None
      per_token = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
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
  ``old_logps`` and ``ref_logps`` may be NaN / inf, and none of it reaches the loss or any gradient;
  every ``aux`` field is 0 / False there. Gradients flow into ``logits`` only (``old_logps``,
  ``ref_logps`` and ``advantages`` are data), also through ``aux.per_token_logps`` and
  ``aux.per_token_kl``; ``aux.entropy`` carries none. -inf logits (a top-k / top-p mask) are fine
  anywhere: the entropy uses 0 * log 0 = 0. NaN or +inf logits at an unmasked position are a model
  failure and give NaN (every impl), like a NaN logp.

  Bad input: a ValueError (a TypeError too, for a wrong type or dtype: see
  :class:`kernels.checks.ArgumentTypeError`) that names the argument and its allowed range, raised
  before anything compiles. Values are checked where they are concrete; under ``jax.jit`` an unmasked
  id outside [0, V), a NaN / inf advantage and a traced ``num_items_in_batch <= 0`` give a NaN loss
  instead (never a finite wrong number), in every impl.

  Args:
    beta: KL weight, >= 0. epsilon_low: in [0, 1). epsilon_high: >= 0. temperature: > 0, finite.
    max_log_ratio: > 0, or None for no clamp.
    impl: ``"pallas"`` runs the kernel (in the Pallas interpreter on CPU), ``"xla"`` the reference,
      ``"auto"`` the kernel on TPU / GPU and the reference on CPU (the interpreter is a correctness
      tool, not a fast path).
    platform, interpret: the kernel target (default: :func:`kernels.backend.use_target`, else the
      host's backend). Set ``platform="tpu"`` on a CPU host to lower the Mosaic kernel ahead of time.
    blocks: tile sizes; default from :func:`default_blocks`.
    reuse_logits_buffer: alias dlogits onto the logits buffer in the backward pass, so that a donated
      logits array is overwritten in place instead of allocating a second [N, V] array.

  Returns:
    ``(loss, aux)``: a scalar f32 loss and :class:`GRPOAux`.

  Raises:
    ValueError: see :func:`validate_loss_args` for the full list.
  """
  checks.choice("impl", impl, IMPLS)
  args = validate_loss_args(
    checks.as_array("logits", logits),
    completion_ids,
    completion_mask,
    advantages,
    old_logps=old_logps,
    ref_logps=ref_logps,
    beta=beta,
    epsilon_low=epsilon_low,
    epsilon_high=epsilon_high,
    temperature=temperature,
    loss_type=loss_type,
    max_completion_length=max_completion_length,
    num_items_in_batch=num_items_in_batch,
    max_log_ratio=max_log_ratio,
  )
  logits, mask, ids, adv, old_logps, ref_logps = (
    args.logits,
    args.mask,
    args.ids,
    args.advantages,
    args.old_logps,
    args.ref_logps,
  )
  target = backend.resolve(platform, interpret)
  impl, blocks = autotune.resolve("grpo_loss", impl, blocks, target, dict(dtype=jnp.dtype(logits.dtype).name, tokens=logits.shape[0] * logits.shape[1], vocab=logits.shape[2]))  # fmt: skip
  if impl == "xla" or (impl == "auto" and target.platform == "cpu"):
    return grpo_loss_reference(
      logits,
      ids,
      mask,
      adv,
      old_logps=old_logps,
      ref_logps=ref_logps,
      loss_type=loss_type,
      max_completion_length=max_completion_length,
      num_items_in_batch=num_items_in_batch,
      **args.options,
    )

  if impl == "mosaic_gpu":  # the Mosaic GPU kernel (Hopper); impl="pallas" is Triton on GPU
    return _mosaic_gpu.grpo_loss(logits, ids, mask, adv, old_logps=old_logps, ref_logps=ref_logps, target=target, blocks=blocks, loss_type=loss_type, max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch, reuse_logits_buffer=reuse_logits_buffer, **args.options)  # fmt: skip
  b, t, v = logits.shape
  n = b * t
  blocks = default_blocks(target, n, v) if blocks is None else blocks
  blocks.check(target, n, v)
  cfg = _pallas.LossConfig(
    target=target,
    blocks=blocks,
    vocab=v,
    on_policy=old_logps is None,
    reuse_logits_buffer=reuse_logits_buffer,
    **args.options,
  )
  zeros = jnp.zeros((n,), jnp.float32)
  flat = lambda a: zeros if a is None else a.reshape(n)
  per_token, kl, logp, entropy, clipped = _pallas.per_token_terms(
    cfg,
    logits.reshape(n, v),
    ids.reshape(n),
    flat(old_logps),
    flat(ref_logps),
    flat(jnp.broadcast_to(adv[:, None], (b, t))),
  )
  shaped = lambda a: a.reshape(b, t)
  loss = reduce_loss(
    shaped(per_token),
    mask,
    loss_type=loss_type,
    max_completion_length=max_completion_length,
    num_items_in_batch=num_items_in_batch,
  )
  return loss, make_aux(mask, shaped(logp), shaped(entropy), shaped(clipped) > 0, shaped(kl))


class LossArgs(NamedTuple):
  """Validated loss inputs, as every impl consumes them."""

  logits: jax.Array  # [B, T, V] (a ShapeDtypeStruct for the fused LM-head loss)
  mask: jax.Array  # [B, T] bool
  ids: jax.Array  # [B, T] int32, 0 at masked positions
  advantages: jax.Array  # [B] f32, stop_gradient
  old_logps: jax.Array | None  # [B, T] f32, stop_gradient, 0 at masked positions
  ref_logps: jax.Array | None  # [B, T] f32, same
  options: dict  # beta, epsilon_low, epsilon_high, temperature, max_log_ratio as Python floats


def validate_loss_args(
  logits,  # [B, T, V] array, or a ShapeDtypeStruct of it
  completion_ids,  # [B, T]
  completion_mask,  # [B, T]
  advantages,  # [B]
  *,
  old_logps,  # [B, T] or None
  ref_logps,  # [B, T] or None
  beta,
  epsilon_low,
  epsilon_high,
  temperature,
  loss_type,
  max_completion_length,
  num_items_in_batch,
  max_log_ratio,
) -> LossArgs:
  """The one check of the policy-loss arguments (``grpo_loss`` and ``fused_linear_grpo_loss``).

  Raises ValueError (ArgumentTypeError, also a TypeError, for types / dtypes) for: logits not a
  floating [B, T, V] array with V >= 1; ids / mask / advantages / old / ref shapes that do not match
  it; non-integer ids; unknown ``loss_type``; ``beta`` < 0, ``epsilon_low`` outside [0, 1),
  ``epsilon_high`` < 0, ``temperature`` <= 0, ``max_log_ratio`` <= 0 (each must also be a finite
  Python number); ``max_completion_length`` not a positive int; ``ref_logps`` missing with
  beta != 0; and, where the values are concrete: ids outside [0, V) at unmasked positions, NaN / inf
  advantages, NaN / +inf ``old_logps`` / ``ref_logps`` at unmasked positions (-inf is legal: the
  clamp bounds it), ``num_items_in_batch`` <= 0 or non-finite.

  Returns the inputs as jax arrays (Python lists accepted), with masked positions zeroed so that
  nothing non-finite there reaches any arithmetic.
  """
  checks.choice("loss_type", loss_type, LOSS_TYPES)
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
  context = f" to match logits {tuple(logits.shape)}"
  for name, arr, shape in (
    ("completion_ids", ids, (b, t)),
    ("completion_mask", mask, (b, t)),
    ("advantages", adv, (b,)),
    ("old_logps", old, (b, t)),
    ("ref_logps", ref, (b, t)),
  ):
    checks.shape(name, arr, shape, context)
  checks.dtype_kind("completion_ids", ids, "integer")
  for name, arr in (("advantages", adv), ("old_logps", old), ("ref_logps", ref)):
    if arr is not None and not jnp.issubdtype(arr.dtype, jnp.number):
      raise checks.ArgumentTypeError(f"{name} must be numeric, got {arr.dtype}")
  options = dict(
    beta=checks.real("beta", beta, lo=0.0),
    epsilon_low=checks.real("epsilon_low", epsilon_low, lo=0.0, hi=1.0, hi_open=True),
    epsilon_high=checks.real("epsilon_high", epsilon_high, lo=0.0),
    temperature=checks.real("temperature", temperature, lo=0.0, lo_open=True),
    max_log_ratio=None
    if max_log_ratio is None
    else checks.real("max_log_ratio", max_log_ratio, lo=0.0, lo_open=True),
  )
  if options["beta"] != 0.0 and ref is None:
    raise ValueError("ref_logps is required when beta != 0")
  checks.positive_int("max_completion_length", max_completion_length, allow_none=True)
  checks.positive_count("num_items_in_batch", num_items_in_batch)
  mask = mask if mask.dtype == jnp.bool_ else mask != 0
  checks.index_range("completion_ids", ids, v, where=mask, qualifier="unmasked")
  checks.finite("advantages", adv)
  checks.finite("old_logps", old, where=mask, allow_neg_inf=True)
  checks.finite("ref_logps", ref, where=mask, allow_neg_inf=True)
  # Zero at masked positions: their values (padding ids, stale NaN log-probs) never reach arithmetic.
  keep = lambda a: (
    None if a is None else jnp.where(mask, jax.lax.stop_gradient(a), 0).astype(jnp.float32)
  )
  return LossArgs(
    logits=logits,
    mask=mask,
    ids=jnp.where(mask, ids.astype(jnp.int32), 0),
    advantages=jax.lax.stop_gradient(adv.astype(jnp.float32)),
    old_logps=keep(old),
    ref_logps=keep(ref),
    options=options,
  )
