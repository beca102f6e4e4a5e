"""``grpo_loss``: the GRPO policy loss from logits, as a Pallas kernel beside its pure-JAX reference."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from kernels import autotune, backend
from kernels.grpo_loss import mosaic_gpu as _mosaic_gpu
from kernels.grpo_loss import pallas as _pallas
from kernels.grpo_loss.blocks import LossBlocks, default_blocks
from kernels.grpo_loss.reference import (
  LOSS_TYPES,
  GRPOAux,
  grpo_loss_reference,
  make_aux,
  reduce_loss,
)

__all__ = [
  "LOSS_TYPES",
  "GRPOAux",
  "LossBlocks",
  "default_blocks",
  "grpo_loss",
  "grpo_loss_reference",
]

IMPLS = ("auto", "pallas", "xla", "mosaic_gpu")


def grpo_loss(
  logits,  # [B, T, V] bf16/f32; logits[b, t] scores completion_ids[b, t] (already shifted)
  completion_ids,  # [B, T] int
  completion_mask,  # [B, T] 0/1 (bool, int or float)
  advantages,  # [B] f32
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
  impl: str = "auto",
  platform: backend.Platform | None = None,
  interpret: bool | None = None,
  blocks: LossBlocks | None = None,
  reuse_logits_buffer: bool = False,
) -> tuple[jax.Array, GRPOAux]:
  """GRPO clipped-surrogate loss (TRL / Liger semantics), differentiable w.r.t. ``logits``.

  Per token, in float32 whatever the logits dtype::

      logp      = log_softmax(logits / temperature)[completion_id]
      ratio     = exp(logp - old)            # old = stop_gradient(logp) when old_logps is None
      per_token = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
      per_token += beta * (exp(ref - logp) - (ref - logp) - 1)      # k3 KL, only when beta != 0

  Reduction over masked tokens (an all-masked row contributes nothing and never makes a NaN):

      grpo:    mean_b( sum_t(per_token * mask) / max(sum_t mask, 1) )
      bnpo:    sum(per_token * mask) / max(sum(mask), 1)
      dr_grpo: sum(per_token * mask) / (B * max_completion_length)       # default T
      dapo:    sum(per_token * mask) / num_items_in_batch                # default max(sum(mask), 1)

  Masked positions are ignored entirely (their ids may be anything, e.g. -100 padding) and every
  ``aux`` field is 0 / False there. Gradients flow into ``logits`` only: ``old_logps``,
  ``ref_logps`` and ``advantages`` are treated as data (stop_gradient).

  Args:
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
    ValueError: mismatched shapes, non-integer ids, ids outside [0, V) at unmasked positions (checked
      when the ids are concrete; under jit such a token yields a NaN loss instead), missing
      ``ref_logps`` with ``beta != 0``, unknown ``loss_type`` or ``impl``, non-positive temperature.
  """
  validate_loss_args(
    logits,
    completion_ids,
    completion_mask,
    advantages,
    old_logps,
    ref_logps,
    beta,
    epsilon_low,
    epsilon_high,
    temperature,
    loss_type,
    max_completion_length,
    impl,
  )
  mask = completion_mask if completion_mask.dtype == jnp.bool_ else completion_mask != 0
  ids = jnp.where(mask, completion_ids.astype(jnp.int32), 0)
  options = dict(
    beta=float(beta),
    epsilon_low=float(epsilon_low),
    epsilon_high=float(epsilon_high),
    temperature=float(temperature),
  )
  target = backend.resolve(platform, interpret)
  impl, blocks = autotune.resolve("grpo_loss", impl, blocks, target, dict(dtype=jnp.dtype(logits.dtype).name, tokens=logits.shape[0] * logits.shape[1], vocab=logits.shape[2]))  # fmt: skip
  if impl == "xla" or (impl == "auto" and target.platform == "cpu"):
    return grpo_loss_reference(
      logits,
      ids,
      mask,
      advantages,
      old_logps=old_logps,
      ref_logps=ref_logps,
      loss_type=loss_type,
      max_completion_length=max_completion_length,
      num_items_in_batch=num_items_in_batch,
      **options,
    )

  if impl == "mosaic_gpu":  # the Mosaic GPU kernel (Hopper); impl="pallas" is Triton on GPU
    return _mosaic_gpu.grpo_loss(logits, ids, mask, advantages, old_logps=old_logps, ref_logps=ref_logps, target=target, blocks=blocks, loss_type=loss_type, max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch, reuse_logits_buffer=reuse_logits_buffer, **options)  # fmt: skip
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
    **options,
  )
  flat = lambda a: jax.lax.stop_gradient(jnp.asarray(a, jnp.float32)).reshape(n)
  zeros = jnp.zeros((n,), jnp.float32)
  adv = jnp.broadcast_to(jnp.asarray(advantages, jnp.float32)[:, None], (b, t))
  per_token, kl, logp, entropy, clipped = _pallas.per_token_terms(
    cfg,
    logits.reshape(n, v),
    ids.reshape(n),
    zeros if old_logps is None else flat(old_logps),
    zeros if ref_logps is None else flat(ref_logps),
    flat(adv),
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


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def validate_loss_args(
  logits,
  ids,
  mask,
  advantages,
  old_logps,
  ref_logps,
  beta,
  epsilon_low,
  epsilon_high,
  temperature,
  loss_type,
  max_completion_length,
  impl,
):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if loss_type not in LOSS_TYPES:
    raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
  if getattr(logits, "ndim", None) != 3:
    raise ValueError(f"logits must be [B, T, V], got shape {getattr(logits, 'shape', None)}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits must be floating point, got {logits.dtype}")
  b, t, v = logits.shape
  if v < 1:
    raise ValueError("logits has an empty vocabulary axis")
  for name, arr, shape in (
    ("completion_ids", ids, (b, t)),
    ("completion_mask", mask, (b, t)),
    ("advantages", advantages, (b,)),
    ("old_logps", old_logps, (b, t)),
    ("ref_logps", ref_logps, (b, t)),
  ):
    if arr is not None and tuple(jnp.shape(arr)) != shape:
      raise ValueError(
        f"{name} must have shape {shape} to match logits {logits.shape}, got {jnp.shape(arr)}"
      )
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"completion_ids must be integers, got {ids.dtype}")
  if beta != 0.0 and ref_logps is None:
    raise ValueError("ref_logps is required when beta != 0")
  for name, value in (
    ("beta", beta),
    ("epsilon_low", epsilon_low),
    ("epsilon_high", epsilon_high),
    ("temperature", temperature),
  ):
    if not isinstance(value, numbers.Real):
      raise ValueError(
        f"{name} must be a Python number (it is a static kernel setting), got {type(value)}"
      )
  if not (np.isfinite(temperature) and temperature > 0):
    raise ValueError(f"temperature must be positive and finite, got {temperature}")
  if epsilon_low < 0 or epsilon_high < 0:
    raise ValueError(
      f"epsilons must be >= 0, got epsilon_low={epsilon_low}, epsilon_high={epsilon_high}"
    )
  if max_completion_length is not None and (
    not isinstance(max_completion_length, numbers.Integral) or max_completion_length <= 0
  ):
    raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
  if _is_concrete(ids) and _is_concrete(mask):
    ids_np, mask_np = np.asarray(ids), np.asarray(mask) != 0
    bad = mask_np & ((ids_np < 0) | (ids_np >= v))
    if bad.any():
      first = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(
        f"{int(bad.sum())} unmasked completion_ids outside [0, {v}); first at {first}: "
        f"{int(ids_np[first])}"
      )
