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

import jax
import jax.numpy as jnp

from kernels import backend, checks, loss_spec, ops
from kernels.grpo_loss.args import LossArgs, validate_loss_args
from kernels.grpo_loss.impls import IMPLEMENTATIONS, OP, Call
from kernels.grpo_loss.pallas_blocks import LossBlocks, default_blocks
from kernels.grpo_loss.reference import GRPOAux, grpo_loss_reference, token_logps_and_entropy
from kernels.loss_spec import DEFAULT_MAX_LOG_RATIO, LOSS_TYPES, LossSpec
from kernels.sharding import KernelSharding, local_batch

__all__ = [
  "DEFAULT_MAX_LOG_RATIO",
  "IMPLEMENTATIONS",
  "IMPLS",
  "LOSS_TYPES",
  "OP",
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

# ("auto", "pallas", "xla", "mosaic_gpu"): the table's, for callers that list them
IMPLS = OP.choices


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
  OP.check(impl)
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
  impl, blocks = _choose(impl, blocks, target, shape)
  scale = checks.loss_scale(loss_scale)
  call = Call(
    args, spec, num_items_in_batch, target, blocks, reuse_logits_buffer, scale, sharding, n
  )
  return OP[impl].run(call)


def _choose(impl: str, blocks, target, shape: dict):
  """(impl, blocks) the call runs: the tuned cache and ``auto``'s platform default
  (:meth:`kernels.ops.Op.resolve`), then the impl's legality (``supported_on``) before anything
  compiles. Blocks the kernel cannot compile with here: ``impl="auto"`` with no blocks of the
  caller's runs the reference (a warning says why); an explicit impl or the caller's own blocks are
  a ValueError (a TypeError for blocks of another impl). An impl without blocks ignores them."""
  fallback_ok = impl == "auto" and blocks is None
  impl, blocks = OP.resolve(impl, blocks, target, shape)
  entry = OP[impl]
  if not entry.blocks:
    return impl, None
  entry.check_blocks_type(impl, blocks)
  reason = entry.supported_on(target, shape, blocks)
  return ops.fallback(OP, "auto" if fallback_ok else impl, reason, stacklevel=4), blocks
