"""The GRPO loss of a kernel impl as one custom VJP: two passes over [N, V] when only the loss is
differentiated, three when aux outputs are.

``loss_logps(static, logits, ids, data) -> (loss, logp, entropy)``, token-level specs only:

* primal (no differentiation): the statistics kernel (one read of the logits), the shared [B, T]
  objective on its log p.
* forward under differentiation: the training kernel reads the logits once and writes dlogits for
  the loss's cotangent 1 (``train.train_fwd``: the coefficient g is computed in-kernel from the token's
  log p, its inputs and its loss weight). The loss value is the same [B, T] objective on its log p.
* backward, told by ``jax.custom_vjp``'s symbolic zeros which outputs carry a cotangent:
  - only the loss (the training step): dlogits * ct. When ct is the constant 1 (``jax.grad`` of the
    loss) XLA's algebraic simplifier removes the multiply and the converts: no pass over [N, V]; a
    traced ct (a loop's ``loss * scale``) costs one fused elementwise pass. Callers that scale the loss
    pass ``loss_scale=`` to ``kernels.grpo_loss`` instead: it is folded into the in-kernel weights,
    so the cotangent stays 1 (the micro-batch scaling of rl/update.py).
  - per_token_logps (also per_token_kl, a function of it) too: the three-pass backward, g = ct_loss *
    d loss / d logp + ct_logp from the saved statistics and a second read of the logits; the
    forward's dlogits go unused (one wasted write, for callers outside the training step).

Sequence-level specs (GSPO, sequence IS modes) know a token's weight only after its whole sequence:
they keep the three-pass path (``pallas.token_logps``: statistics forward, [B, T] objective, backward).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from kernels.grpo_loss import mosaic_gpu_train as _mosaic_train
from kernels.grpo_loss import pallas as _pallas
from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.grpo_loss.reference import reduce_loss
from kernels.objective import policy_objective
from kernels.sharding import KernelSharding, shard_rows


@dataclasses.dataclass(frozen=True)
class Static:
  """Hashable settings: the kernel config (a train.TrainConfig around a pallas.LossConfig or a
  mosaic_gpu.MosaicLossConfig) and the [B, T] shape the objective sees."""

  kernel: object
  batch: int
  seq: int
  sharding: KernelSharding | None = None  # the kernels run shard-local over its batch axes


def loss_value(static: Static, logp, data: dict):
  """The scalar loss of log p [N] (the shared objective and reduction, times ``data["scale"]``)."""
  b, t = static.batch, static.seq
  spec = static.kernel.spec
  logps = {k: data[k] for k in ("old_logps", "ref_logps", "sampler_logps")}
  obj = policy_objective(logp.reshape(b, t), data["mask"], data["advantages"], spec, **logps)
  loss = reduce_loss(
    obj.per_token,
    data["mask"],
    loss_type=spec.loss_type,
    max_completion_length=spec.max_completion_length,
    num_items_in_batch=data["num_items_in_batch"],
  )
  return loss if data["scale"] is None else loss * data["scale"]


def token_inputs(static: Static, data: dict):
  """[N, k] f32: the per-token inputs of the in-kernel coefficient (train.TOKEN_FIELDS order).

  The weight of a token is d loss / d per_token: every reduction is linear in the per-token losses,
  so it is the gradient of the reduction at 0 (times the loss scale)."""
  b, t = static.batch, static.seq
  spec = static.kernel.spec
  reduce = functools.partial(
    reduce_loss,
    mask=data["mask"],
    loss_type=spec.loss_type,
    max_completion_length=spec.max_completion_length,
    num_items_in_batch=data["num_items_in_batch"],
  )
  weight = jax.grad(reduce)(jnp.zeros((b, t), jnp.float32))
  if data["scale"] is not None:
    weight = weight * data["scale"]
  cols = dict(data, weight=weight, mask=data["mask"].astype(jnp.float32))
  return jnp.stack([cols[k].reshape(b * t).astype(jnp.float32) for k in static.kernel.fields], 1)


def _kernels(static: Static):
  """(stats, train, grad) of the impl: stats(x, ids, thr) -> (logp, ent, res); train(x, ids, tok,
  thr) -> (logp, ent, res, dlogits); grad(x, ids, res, g, thr) -> dlogits; thr: [N] support
  thresholds or None (no gap). Every argument and result is per row; with a sharding each runs
  shard-local over its batch axes (a Mosaic call cannot be partitioned)."""
  cfg = static.kernel
  if isinstance(cfg.loss, LossConfig):
    loss = cfg.loss
    stats = lambda x, ids, thr: (lambda o: (o[0], o[1], o[2:]))(_pallas.fwd_call(loss, x, ids, thr))
    train = lambda x, ids, tok, thr: (lambda o: (o[0], o[1], o[2:4], o[4]))(
      _pallas.train_fwd(cfg, x, ids, tok, thr)
    )
    grad = lambda x, ids, res, g, thr: _pallas.bwd_call(loss, x, ids, *res, g, thr)
  else:
    stats, train, grad = _mosaic_train.train_kernels(cfg)
  return tuple(shard_rows(static.sharding, f) for f in (stats, train, grad))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def loss_logps(static: Static, logits, ids, data):
  """(loss, logp [N], entropy [N]) of logits [N, V] and ids [N] int32; data: the validated [B, T]
  inputs (mask, advantages, old / ref / sampler log-probs or None), num_items_in_batch, the loss
  scale (or None) and ``thr``, the [N] support thresholds (or None: no gap). Differentiable w.r.t.
  logits through loss and logp."""
  logp, ent, _ = _kernels(static)[0](logits, ids, data["thr"])
  return loss_value(static, logp, data), logp, ent


def _fwd(static: Static, logits, ids, data):
  logits, ids = logits.value, ids.value
  data = jax.tree.map(lambda p: p.value, data)
  _, train, _ = _kernels(static)
  logp, ent, res, dlogits = train(logits, ids, token_inputs(static, data), data["thr"])
  return (loss_value(static, logp, data), logp, ent), (logits, ids, data, logp, res, dlogits)


def _bwd(static: Static, residuals, cts):
  logits, ids, data, logp, res, dlogits = residuals
  ct_loss, ct_logp, _ = cts  # the entropy carries no gradient
  no_loss = isinstance(ct_loss, SymbolicZero)
  if isinstance(ct_logp, SymbolicZero):
    if no_loss:
      return jnp.zeros_like(logits), None, None
    return apply_cotangent(dlogits, ct_loss), None, None
  g = ct_logp
  if not no_loss:
    g = g + ct_loss * jax.grad(loss_value, argnums=1)(static, logp, data)
  g = g * (1.0 / static.kernel.loss.temperature)
  return _kernels(static)[2](logits, ids, res, g, data["thr"]), None, None


loss_logps.defvjp(_fwd, _bwd, symbolic_zeros=True)


def apply_cotangent(dlogits, ct):
  """dlogits [N, V] (for cotangent 1) times the loss's cotangent ct (a scalar), rounded once to
  dlogits' dtype. With ct the constant 1 (``jax.grad`` of the loss) XLA's algebraic simplifier
  removes the multiply and both converts: no pass over [N, V]; a traced ct costs one fused pass."""
  return (dlogits.astype(jnp.float32) * ct).astype(dlogits.dtype)
