"""The fused LM-head loss as one custom VJP: the gradients are computed in the forward pass (the logits
are formed once, ``chunked`` with token-level options, or recomputed tile by tile, ``pallas`` /
``mosaic_gpu``) and scaled by the loss's cotangent in the backward. With a vocabulary axis, every
piece runs per vocabulary shard (``shard_map``) and the shards' statistics are combined exactly."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels.fused_linear import chunked as _chunked
from kernels.fused_linear import gap as _gap
from kernels.fused_linear import mosaic_gpu as _mosaic
from kernels.fused_linear import pallas_tpu as _pallas
from kernels.fused_linear import pallas_tpu_grads as _pallas_grads
from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.grpo_loss.reference import make_aux, reduce_loss
from kernels.loss_spec import LossSpec
from kernels.objective import policy_objective


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything static about one call (hashable: it is a custom_vjp non-differentiable argument)."""

  impl: str  # "pallas" | "mosaic_gpu" | "chunked"
  fused: _pallas.FusedConfig | _mosaic.MosaicLinearConfig | None
  softmax: LossConfig  # the grpo_loss softmax kernels' config (chunked path)
  chunk: int
  mesh: Mesh | None
  axis: str | None
  batch: int
  seq: int
  loss: LossSpec
  present: tuple  # (old_logps, ref_logps, sampler_logps) given; absent ones are zero placeholders
  rows: tuple[str, ...] = ()  # mesh axes splitting the tokens (with mesh): shard-local rows
  gapped: bool = False  # a support gap was given: every sweep takes each row's threshold


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_loss(static, h, w, ids, mask, adv, old, ref, sampler, gap, num_items, scale):
  args = (h, w, ids, mask, adv, old, ref, sampler, gap, num_items, scale)
  return _compute(static, *args, with_grads=False)[0]


def _loss_fwd(static, h, w, ids, mask, adv, old, ref, sampler, gap, num_items, scale):
  args = (h, w, ids, mask, adv, old, ref, sampler, gap, num_items, scale)
  return _compute(static, *args, with_grads=True)


def _loss_bwd(static, res, cts):
  dh, dw = res
  ct = cts[0]  # aux is data (the public op stop-gradients it)
  # ct is the constant 1 under jax.grad of the loss (loss_scale already rode in the weights): XLA
  # folds the multiply and the converts away, so there is no pass over dh / dw
  apply = lambda d: (ct * d.astype(jnp.float32)).astype(d.dtype)
  return apply(dh), apply(dw), *(None,) * 9


fused_loss.defvjp(_loss_fwd, _loss_bwd)


def _given(static: Static, old, ref, sampler) -> dict:
  names = ("old_logps", "ref_logps", "sampler_logps")
  return {k: a if p else None for k, a, p in zip(names, (old, ref, sampler), static.present)}


def _compute(
  static: Static, h, w, ids, mask, adv, old, ref, sampler, gap, num_items, scale, *, with_grads
):
  spec = static.loss
  b, t = static.batch, static.seq
  # gap [N] (a placeholder when not gapped): each row's threshold, formed once before every sweep
  thr = (_gap.thresholds(h, w, ids, gap, spec.temperature),) if static.gapped else ()

  def reduce(per_token):  # [B, T] -> the scaled loss; linear in per_token
    loss = reduce_loss(
      per_token,
      mask=mask,
      loss_type=spec.loss_type,
      max_completion_length=spec.max_completion_length,
      num_items_in_batch=num_items,
    )
    return loss * scale  # loss_scale folded into every token's weight (and g) before the gradients

  def objective(logp):  # [B, T] -> (loss, Objective)
    obj = policy_objective(logp, mask, adv, spec, **_given(static, old, ref, sampler))
    return reduce(obj.per_token), obj

  flat = lambda a: a.reshape(b * t)
  one_pass = static.impl == "chunked" and with_grads and not spec.sequence_level
  if one_pass:
    # Each token's loss depends on its own log p only: g is known chunk by chunk, in the same pass.
    # The reduction is linear in the per-token loss: its gradient is each token's weight in the loss.
    weights = jax.grad(reduce)(jnp.zeros((b, t), jnp.float32))
    tok = (flat(mask), flat(adv), flat(old), flat(ref), flat(sampler), flat(weights))
    (lse, logp, entropy), dh, dw = _sharded(static, _local_one_pass, True, h, w, ids, thr + tok)
  else:
    # the training path's Mosaic statistics pass may store exp(z - m) of the first columns for grads
    store = with_grads and static.impl == "mosaic_gpu" and static.mesh is None
    store = store and static.fused.blocks.stored_cols > 0
    local = functools.partial(_local_stats, store=store)
    (lse, logp, entropy), *stored = _sharded(static, local, False, h, w, ids, thr)
  logp = logp.reshape(b, t)
  if with_grads and not one_pass:
    # a token's weight depends on its whole sequence: g = d loss / d logp from the [B, T] objective,
    # then the gradient pass over the vocabulary
    (loss, obj), dlogp = jax.value_and_grad(objective, has_aux=True)(logp)
    g = dlogp.reshape(-1) * (1.0 / spec.temperature)
    extra = (lse, g, *stored) if store else (lse, g)
    _, dh, dw = _sharded(static, _local_grads, True, h, w, ids, thr + extra)
  else:
    loss, obj = objective(logp)
  aux = make_aux(mask, logp, entropy.reshape(b, t), obj)
  if not with_grads:
    return (loss, aux), None
  return (loss, aux), (dh.astype(h.dtype), dw.astype(w.dtype))


def _sharded(static: Static, local, with_grads: bool, h, w, ids, extra):
  """``local(static, h_rows, w_shard, ids_local, *extra)`` -> ((lse, logp, entropy) | (), dh, dw),
  run on every (token rows, vocabulary) shard (shard_map) or on the whole problem. Every ``extra``
  is per token ([n]); dh comes back split like h, dw like w (summed over the row shards)."""
  if static.mesh is None:
    return local(static, h, w, ids, *extra)
  rows, by_vocab = P(static.rows or None), P(None, static.axis)
  stats_out = () if local is _local_grads else (rows,) * 3
  return jax.shard_map(
    functools.partial(local, static),
    mesh=static.mesh,
    in_specs=(rows, by_vocab, rows, *((rows,) * len(extra))),
    out_specs=(stats_out, rows if with_grads else P(), by_vocab if with_grads else P()),
    check_vma=False,
  )(h, w, ids, *extra)


def _sum_shards(static: Static, dh, dw):
  """A shard's (dh, dw) summed where other shards hold parts: dh over the vocabulary shards, dw
  (f32) over the token-row shards."""
  if static.axis is not None:
    dh = jax.lax.psum(dh, static.axis)
  if static.rows:
    dw = jax.lax.psum(dw, static.rows)
  return dh, dw


def _shard_ids(static: Static, w, ids):
  """ids relative to this vocabulary shard (outside [0, V_shard): another shard's token)."""
  return ids - jax.lax.axis_index(static.axis) * w.shape[1] if static.axis is not None else ids


def _combine(static: Static, lse_s, chosen_s, found_s, ez_s):
  """The shards' statistics combined: (global lse, logp, entropy), each [n] f32."""
  axis = static.axis
  if axis is None:
    lse, chosen, found, ez = lse_s, chosen_s, found_s, ez_s
  else:
    top = jax.lax.pmax(lse_s, axis)
    lse = top + jnp.log(jax.lax.psum(jnp.exp(lse_s - top), axis))
    chosen, found = jax.lax.psum(chosen_s, axis), jax.lax.psum(found_s, axis)
    ez = jax.lax.psum(jnp.exp(lse_s - lse) * ez_s, axis)
  logp = jnp.where(found > 0, chosen - lse, jnp.nan)  # an id outside [0, V) poisons, never hides
  return lse, logp, lse - ez


def _split_thr(static: Static, extra: tuple):
  """(thr [n] or None, the rest): a gapped call's per-token extras start with the thresholds."""
  return (extra[0], extra[1:]) if static.gapped else (None, extra)


def _local_stats(static: Static, h, w, ids, *thr, store: bool = False):
  """The statistics pass: ((lse, logp, entropy), -, -), no gradients; with ``store`` (mosaic_gpu,
  one shard) ((lse, logp, entropy), pt, mt): the stored exp(z - m) for :func:`_local_grads`.
  ``thr``: (thresholds [n],) of a gapped call, else ()."""
  thr, _ = _split_thr(static, thr)
  ids = _shard_ids(static, w, ids)
  if static.impl == "chunked":
    finish = lambda lse, chosen, found, ez, tok: (
      None,
      None,
      _combine(static, lse, chosen, found, ez),
    )
    stats, _, _ = _chunked.run(static.softmax, static.chunk, h, w, ids, (), finish, False, thr)
  elif store:
    partials, (pt, mt) = _mosaic.stats(static.fused, h, w, ids, thr, store=True)
    return _combine(static, *partials), pt, mt
  else:
    kernel = _mosaic.stats if static.impl == "mosaic_gpu" else _pallas.stats
    stats = _combine(static, *kernel(static.fused, h, w, ids, thr))
  empty = jnp.zeros((0,), jnp.float32)  # per call: a module-level array would start the backend
  return stats, empty, empty


def _local_grads(static: Static, h, w, ids, *extra):
  """The gradient pass for known global lse [n] and g = d loss / d z_chosen [n]: ((), dh, dw);
  extra = ([thr,] lse, g, *stored), ``stored``: :func:`_local_stats`'s (pt, mt), whose columns'
  dl needs no recomputed logits."""
  thr, (lse, g, *stored) = _split_thr(static, extra)
  ids = _shard_ids(static, w, ids)
  if static.impl == "chunked":
    dh, dw = _chunked.run_grads(static.softmax, static.chunk, h, w, ids, lse, g, thr)
  else:
    # Whole gradients are final: stored in the input dtypes; shards' parts sum in f32.
    dtype = jnp.float32 if static.axis else h.dtype
    dw_dtype = jnp.float32 if static.rows else w.dtype
    if static.impl == "mosaic_gpu":
      dh, dw = _mosaic.grads(static.fused, h, w, ids, lse, g, dtype, dw_dtype, stored or None, thr)
    else:
      dh, dw = _pallas_grads.grads(static.fused, h, w, ids, lse, g, dtype, dw_dtype, thr=thr)
  return (), *_sum_shards(static, dh, dw)


def _local_one_pass(static: Static, h, w, ids, *extra):
  """Chunked, token-level options: statistics, each token's g and the gradients in one pass;
  extra = ([thr,] mask, adv, old, ref, sampler, weights)."""
  spec = static.loss
  thr, tok = _split_thr(static, extra)

  def finish(lse_s, chosen_s, found_s, ez_s, tok):
    mask_c, adv_c, old_c, ref_c, s_c, w_c = (a[None] for a in tok)  # a [1, c] "batch"
    lse, logp, entropy = _combine(static, lse_s, chosen_s, found_s, ez_s)
    per_token = lambda lp: (
      policy_objective(lp, mask_c, adv_c, spec, **_given(static, old_c, ref_c, s_c)).per_token
    )
    # token-level: per_token[t] depends on logp[t] alone, so the VJP with the loss weights is g
    _, vjp = jax.vjp(per_token, logp[None])
    g = vjp(w_c)[0][0] * (1.0 / spec.temperature)
    return lse, g, (lse, logp, entropy)

  ids = _shard_ids(static, w, ids)
  stats, dh, dw = _chunked.run(static.softmax, static.chunk, h, w, ids, tok, finish, True, thr)
  return stats, *_sum_shards(static, dh, dw)
