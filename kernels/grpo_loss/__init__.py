"""``grpo_loss``: the GRPO policy loss from logits, as a Pallas kernel beside its pure-JAX reference.

The loss is described by a :class:`kernels.LossSpec` (``spec=``, or its fields as keywords). Per
token, in float32 whatever the logits dtype (``M = max_log_ratio``; every option's formula:
:func:`kernels.objective.policy_objective`)::

    logp      = log_softmax(logits / temperature)[completion_id]
    ratio     = exp(clamp(logp - old, -M, M))   # old = stop_gradient(logp) when old_logps is None
                                                 # GSPO: the sequence's masked-mean log-ratio
    per_token = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
    per_token = min(per_token, epsilon_c * |A|) where A < 0      # dual clip, when epsilon_c is set
    per_token *= stop_gradient(w)     # importance weight of the sampler's log-probs, when is_mode is set
    d         = clamp(ref - logp, -M, M)
    per_token += beta * (exp(d) - d - 1)         # k3 KL, only when beta != 0

``clamp`` has zero gradient at and beyond the bound (tunix's guard): a stale or mismatched sampler
(``old_logps`` 100 nats off) or a -inf chosen logit gives a finite loss and gradient instead of inf /
NaN. Below the bound the result is bit for bit the unclamped formula; ``max_log_ratio=None`` disables
the clamp. Reduction over masked tokens (an all-masked row contributes nothing and never makes a NaN)::

    grpo:    mean_b( sum_t(per_token * mask) / max(sum_t mask, 1) )
    bnpo:    sum(per_token * mask) / max(sum(mask), 1)
    dr_grpo: sum(per_token * mask) / (B * max_completion_length)       # default T
    dapo:    sum(per_token * mask) / num_items_in_batch                # default max(sum(mask), 1)

Masked positions are ignored entirely: their ids may be anything (e.g. -100 padding), their logits,
advantages (when [B, T]), ``old_logps``, ``ref_logps`` and ``sampler_logps`` may be NaN / inf, and none
of it reaches the loss or any gradient; every ``aux`` field is 0 / False there. Gradients flow into
``logits`` only (the other arrays are data), also through ``aux.per_token_logps`` and
``aux.per_token_kl``; the other aux fields carry none. -inf logits (a top-k / top-p mask) are fine
anywhere: the entropy uses 0 * log 0 = 0. NaN or +inf logits at an unmasked position are a model
failure and give NaN (every impl), like a NaN logp.

Bad input: a ValueError (a TypeError too, for a wrong type or dtype: see
:class:`kernels.checks.ArgumentTypeError`) naming the argument and its allowed range, raised before
anything compiles (:func:`kernels.grpo_loss.args.validate_loss_args`). Values are checked where they are
concrete; under ``jax.jit`` an unmasked id outside [0, V), a NaN / inf advantage and a traced
``num_items_in_batch <= 0`` give a NaN loss instead (never a finite wrong number), in every impl.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import autotune, backend, checks, loss_spec
from kernels.grpo_loss import mosaic_gpu as _mosaic_gpu
from kernels.grpo_loss import pallas as _pallas
from kernels.grpo_loss import pallas_blocks as _blocks
from kernels.grpo_loss import train as _train
from kernels.grpo_loss import vjp as _vjp
from kernels.grpo_loss.args import LossArgs, validate_loss_args
from kernels.grpo_loss.pallas_blocks import LossBlocks, default_blocks
from kernels.grpo_loss.reference import (
  GRPOAux,
  grpo_loss_reference,
  make_aux,
  objective_and_loss,
  token_logps_and_entropy,
)
from kernels.loss_spec import DEFAULT_MAX_LOG_RATIO, LOSS_TYPES, LossSpec
from kernels.objective import policy_objective
from kernels.sharding import KernelSharding, local_batch, shard_rows

__all__ = [
  "DEFAULT_MAX_LOG_RATIO",
  "LOSS_TYPES",
  "GRPOAux",
  "LossArgs",
  "LossBlocks",
  "LossSpec",
  "default_blocks",
  "grpo_loss",
  "grpo_loss_reference",
  "token_logps_and_entropy",
  "validate_loss_args",
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
  sharding: KernelSharding | None = None,  # B's mesh axes: the kernels run shard-local
  **spec_fields,  # LossSpec fields as keywords (beta=..., loss_type=...); with spec= they must agree
) -> tuple[jax.Array, GRPOAux]:
  """GRPO clipped-surrogate loss (TRL / Liger semantics; the formulas: this module's docstring),
  differentiable w.r.t. ``logits``. Returns ``(loss, aux)``: a scalar f32 loss and :class:`GRPOAux`.

  Args:
    sampler_logps: the rollout engine's log-probs; reported as ``aux.sampler_log_ratio`` and used by
      ``is_mode`` (which requires them).
    spec: the loss (:class:`kernels.LossSpec`); its fields may be given as keywords instead (an
      unknown keyword is a TypeError naming the fields).
    impl: ``"pallas"`` runs the kernel (in the Pallas interpreter on CPU), ``"xla"`` the reference,
      ``"mosaic_gpu"`` the Hopper kernel, ``"auto"`` the tuned cache's or the heuristic's choice: the
      kernel on TPU / GPU and the reference on CPU (the interpreter is a correctness tool).
    platform, interpret: the kernel target (default: :func:`kernels.backend.use_target`, else the
      host's backend). Set ``platform="tpu"`` on a CPU host to lower the Mosaic kernel ahead of time.
    blocks: tile sizes; default from :func:`default_blocks`.
    reuse_logits_buffer: alias dlogits onto the logits buffer (the kernel that writes dlogits), so
      that a donated logits array is overwritten in place instead of allocating a second [N, V] array.
    loss_scale: multiplies the loss (e.g. a micro-batch's share of the global loss). Passed here
      rather than multiplied afterwards, the kernels fold it into each token's loss weight, so the
      training path's backward sees cotangent 1 and makes no pass over [N, V] (see
      :mod:`kernels.grpo_loss.vjp`). aux is not scaled.
    sharding: inputs sharded over a mesh: ``KernelSharding(mesh, batch_axes=("dp", "fsdp"))`` splits
      B over those axes (B must divide evenly; the other fields are unused here). The kernels run
      shard-local in a ``shard_map`` (XLA cannot partition a Mosaic call) on B / shards rows each;
      the loss's reductions (token counts, the mean over B) are taken on the whole arrays outside
      it, so loss, aux and gradients equal the unsharded call's. None: no mesh (one device).

  Raises:
    ValueError: see :func:`kernels.grpo_loss.args.validate_loss_args` for the full list.
  """
  checks.choice("impl", impl, IMPLS)
  spec = loss_spec.resolve(spec, **spec_fields)
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
  target = backend.resolve(platform, interpret)
  b, t, v = args.logits.shape
  n = local_batch(sharding, "logits", b) * t  # a kernel's rows: one shard's
  shape = dict(dtype=jnp.dtype(args.logits.dtype).name, tokens=n, vocab=v)
  tuned_impl, tuned_blocks = autotune.resolve("grpo_loss", impl, blocks, target, shape)
  impl, blocks = _legal_on_tpu(tuned_impl, tuned_blocks, blocks is not None, target, shape)
  scale = checks.loss_scale(loss_scale)
  if impl == "xla" or (impl == "auto" and target.platform == "cpu"):
    loss, aux = grpo_loss_reference(
      args.logits, args.ids, args.mask, args.advantages, **_logps(args), spec=spec, num_items_in_batch=num_items_in_batch
    )  # fmt: skip
    return (loss if scale is None else loss * scale), aux
  cfg = _kernel_config(impl, args, target, blocks, spec, reuse_logits_buffer, n)
  if spec.sequence_level:
    loss, aux = _sequence_level(impl, cfg, args, spec, num_items_in_batch, sharding)
    return (loss if scale is None else loss * scale), aux
  return _token_level(cfg, args, spec, num_items_in_batch, scale, sharding)


def _legal_on_tpu(impl, blocks, given: bool, target, shape: dict):
  """(impl, blocks), unless the TPU kernel cannot compile with them here (:func:`blocks.legal_on`):
  then ``impl="auto"`` runs the reference (a warning says why) and an explicit impl or the caller's
  own blocks are a ValueError, before anything reaches Mosaic."""
  if target.platform != "tpu" or impl not in ("auto", "pallas"):
    return impl, blocks
  n, v = shape["tokens"], shape["vocab"]
  reason = _blocks.legal_on(target, blocks or default_blocks(target, n, v), shape)
  if reason is None:
    return impl, blocks
  return _blocks.checked_impl("grpo_loss", "pallas" if given else impl, reason), blocks


def _logps(args: LossArgs) -> dict:
  return dict(old_logps=args.old_logps, ref_logps=args.ref_logps, sampler_logps=args.sampler_logps)


def _kernel_config(impl, args: LossArgs, target, blocks, spec: LossSpec, reuse: bool, n: int):
  """The kernel's static config for its ``n`` rows (one shard's): Mosaic GPU (impl="mosaic_gpu") or
  the Pallas tiled / rowloop one; ``reuse``: reuse_logits_buffer."""
  b, t, v = args.logits.shape
  x = args.logits.reshape(b * t, v)
  if impl == "mosaic_gpu":  # the Hopper kernel; impl="pallas" is Triton on GPU
    return _mosaic_gpu.make_config(x, target=target, blocks=blocks, temperature=spec.temperature, reuse_logits_buffer=reuse)  # fmt: skip
  blocks = default_blocks(target, n, v) if blocks is None else blocks
  blocks.check(target, n, v)
  return _blocks.LossConfig(target, blocks, v, spec.temperature, reuse)


def _token_level(kernel_cfg, args: LossArgs, spec: LossSpec, num_items_in_batch, scale, sharding):
  """The two-pass training path (:mod:`kernels.grpo_loss.vjp`): a token's loss weight is a function
  of its own log p, so the forward writes dlogits in the same pass."""
  b, t, v = args.logits.shape
  data = dict(
    mask=args.mask,
    advantages=args.advantages,
    **_logps(args),
    num_items_in_batch=num_items_in_batch,
    scale=scale,
  )
  present = tuple(k for k in _train.TOKEN_FIELDS[3:] if data[k] is not None)
  cfg = _train.TrainConfig(kernel_cfg, spec, _train.TOKEN_FIELDS[:3] + present)
  x, ids = args.logits.reshape(b * t, v), args.ids.reshape(b * t)
  loss, logp, entropy = _vjp.loss_logps(_vjp.Static(cfg, b, t, sharding), x, ids, data)
  obj = policy_objective(logp.reshape(b, t), args.mask, args.advantages, spec, **_logps(args))
  return loss, make_aux(args.mask, logp.reshape(b, t), entropy.reshape(b, t), obj)


def _sequence_level(impl, kernel_cfg, args: LossArgs, spec: LossSpec, num_items_in_batch, sharding):
  """GSPO / sequence IS modes: the statistics forward, the [B, T] objective, the backward kernel
  (three passes: a token's weight is known only once its whole sequence's log-probs are)."""
  b, t, v = args.logits.shape
  x, ids = args.logits.reshape(b * t, v), args.ids.reshape(b * t)
  kernel = _mosaic_gpu.token_logps_cfg if impl == "mosaic_gpu" else _pallas.token_logps
  logp, entropy = shard_rows(sharding, functools.partial(kernel, kernel_cfg))(x, ids)
  return objective_and_loss(
    logp.reshape(b, t),
    entropy.reshape(b, t),
    args.mask,
    args.advantages,
    spec,
    num_items_in_batch=num_items_in_batch,
    **_logps(args),
  )
