"""``fused_linear_grpo_loss``: the GRPO loss fused with the LM head, so [tokens x vocab] logits never
reach memory whole — optionally with the vocabulary sharded over a mesh axis (tensor parallelism)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels import backend, checks, loss_spec
from kernels.fused_linear import chunked as _chunked
from kernels.fused_linear import mosaic_gpu as _mosaic
from kernels.fused_linear import pallas as _pallas
from kernels.fused_linear import tuned as _tuned
from kernels.fused_linear.blocks import LinearBlocks, default_blocks, default_chunk
from kernels.fused_linear.mosaic_gpu import MosaicLinearBlocks
from kernels.fused_linear.reference import fused_linear_grpo_loss_reference, vocab_stats_reference
from kernels.fused_linear.scaling import checked_loss_scale
from kernels.grpo_loss import blocks as loss_blocks
from kernels.grpo_loss import validate_loss_args
from kernels.grpo_loss.pallas import LossConfig
from kernels.grpo_loss.reference import GRPOAux, make_aux, reduce_loss
from kernels.loss_spec import UNSET, LossSpec
from kernels.objective import policy_objective

__all__ = [
  "IMPLS",
  "LinearBlocks",
  "MosaicLinearBlocks",
  "default_blocks",
  "default_chunk",
  "fused_linear_grpo_loss",
  "fused_linear_grpo_loss_reference",
  "vocab_stats_reference",
]

IMPLS = ("auto", "pallas", "mosaic_gpu", "chunked", "xla")


@dataclasses.dataclass(frozen=True)
class _Spec:
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


def fused_linear_grpo_loss(
  hidden,  # [B, T, H] bf16/f32: final-norm hidden states at the positions scoring completion_ids
  lm_head,  # [H, V], same dtype as hidden
  completion_ids,  # [B, T] int
  completion_mask,  # [B, T] 0/1
  advantages,  # [B] or [B, T] f32
  *,
  old_logps=None,  # [B, T] f32 or None (on-policy)
  ref_logps=None,  # [B, T] f32, required when beta != 0
  sampler_logps=None,  # [B, T] f32: the rollout engine's log-probs of the sampled tokens
  spec: LossSpec | None = None,
  num_items_in_batch=None,
  impl: str = "auto",
  platform: backend.Platform | None = None,
  interpret: bool | None = None,
  blocks: LinearBlocks | MosaicLinearBlocks | None = None,
  chunk_size: int | None = None,
  mesh: Mesh | None = None,
  vocab_axis: str | None = None,
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
  """``kernels.grpo_loss(hidden @ lm_head, ...)`` without the [B, T, V] logits; differentiable w.r.t.
  ``hidden`` and ``lm_head``.

  Same loss (``spec`` / keywords), ``aux``, input checks and jit behaviour as
  :func:`kernels.grpo_loss` (logits are accumulated in f32). ``hidden`` at masked positions may be
  NaN / inf: it is replaced by 0 before the matmul, so it reaches neither the loss nor ``dhidden`` /
  ``dlm_head``.
  The gradients are computed during the forward pass and scaled by the loss cotangent in the backward
  pass, so the logits are formed once (``chunked``, token-level options) or recomputed tile by tile
  (``pallas``) — never stored. ``aux`` is data: it carries no gradient, in every impl (``xla``
  included). The objective (every option) is the shared [B, T] math of :mod:`kernels.objective`; its
  gradient w.r.t. each token's log p becomes the per-row weight of the softmax gradient.

  Args:
    impl: ``"pallas"``: the fully fused kernels (TPU / CPU interpreter; O(tile) memory, 10 N·H·V flops;
      on GPU ``mosaic_gpu`` for bf16 / f16 and ``chunked`` for f32).
      ``"mosaic_gpu"``: the Hopper kernels of :mod:`kernels.fused_linear.mosaic_gpu` (GPU or the Mosaic
      GPU interpreter; bf16 / f16; logits on chip, dl per vocabulary chunk in HBM, 8 N·H·V flops).
      ``"chunked"``: XLA matmuls per token chunk + grpo_loss's Pallas softmax kernels (every backend;
      one f32 [chunk, V] buffer, 6 N·H·V flops; 8 with a sequence-level option, whose token weights
      need a whole first pass). ``"xla"``: the reference, materialising the logits.
      ``"auto"``: the tuned cache's winner for this device and shape (:mod:`.tuned`), else ``xla``
      on CPU (the interpreter is a correctness tool), ``chunked`` on GPU and TPU (fewer flops;
      ``pallas`` when memory matters more). An explicit impl without tiles gets its tuned tiles.
    blocks, chunk_size: tiles of the ``pallas`` (``LinearBlocks``) or ``mosaic_gpu``
      (``MosaicLinearBlocks``) path and tokens per chunk of the ``chunked`` path.
    mesh, vocab_axis: tensor parallelism. ``lm_head`` is split over its vocabulary on mesh axis
      ``vocab_axis`` (``shard_map``): each shard computes its partial max / sum-exp / chosen logit,
      combined across the axis before the loss, and its own slice of the LM-head gradient. The other
      arguments are replicated.
    loss_scale: multiplies the loss (a micro-batch's share), as in :func:`kernels.grpo_loss`:
      folded into each token's weight before the in-forward gradients, so the backward's cotangent
      is 1 and its pass over [H, V] folds away (``loss * s`` costs one). aux is not scaled.

  Raises:
    ValueError: everything ``grpo_loss`` rejects (:func:`kernels.grpo_loss.validate_loss_args`), and
      H or dtype mismatches between ``hidden`` and ``lm_head``, a non-floating dtype, an unknown
      ``impl``, ``impl="mosaic_gpu"`` with f32 or on TPU or with illegal ``MosaicLinearBlocks``, a
      vocabulary the axis does not divide, ``chunk_size`` <= 0, a non-finite ``loss_scale``.
    TypeError: ``impl="mosaic_gpu"`` with ``blocks`` that are not ``MosaicLinearBlocks``; a
      ``loss_scale`` that is not a numeric scalar.
  """
  checks.choice("impl", impl, IMPLS)
  spec = loss_spec.resolve(spec, loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, temperature=temperature, max_log_ratio=max_log_ratio, is_mode=is_mode, is_cap=is_cap, importance_sampling_level=importance_sampling_level, epsilon_c=epsilon_c, max_completion_length=max_completion_length)  # fmt: skip
  hidden, lm_head = checks.as_array("hidden", hidden), checks.as_array("lm_head", lm_head)
  checks.ndim_array("hidden", hidden, 3, "[B, T, H]")
  checks.ndim_array("lm_head", lm_head, 2, "[H, V]")
  checks.dtype_kind("hidden", hidden, "floating")
  b, t, hd = hidden.shape
  if lm_head.shape[0] != hd:
    raise ValueError(
      f"hidden size mismatch: hidden is [B, T, {hd}] but lm_head is {lm_head.shape} (expected "
      f"[{hd}, V]; a [V, H] embedding matrix must be transposed)"
    )
  if hidden.dtype != lm_head.dtype:
    raise ValueError(
      f"hidden ({hidden.dtype}) and lm_head ({lm_head.dtype}) must have the same dtype"
    )
  v = lm_head.shape[1]
  args = validate_loss_args(
    jax.ShapeDtypeStruct((b, t, v), hidden.dtype),
    completion_ids,
    completion_mask,
    advantages,
    old_logps=old_logps,
    ref_logps=ref_logps,
    sampler_logps=sampler_logps,
    spec=spec,
    num_items_in_batch=num_items_in_batch,
  )
  checks.positive_int("chunk_size", chunk_size, allow_none=True)
  if (mesh is None) != (vocab_axis is None):
    raise ValueError("pass mesh and vocab_axis together (or neither)")
  tp = 1
  if mesh is not None:
    if vocab_axis not in mesh.axis_names:
      raise ValueError(f"vocab_axis {vocab_axis!r} is not an axis of the mesh {mesh.axis_names}")
    tp = mesh.shape[vocab_axis]
    if v % tp:
      raise ValueError(f"V={v} is not divisible by the {tp} shards of mesh axis {vocab_axis!r}")

  scale = checked_loss_scale(loss_scale)
  target = backend.resolve(platform, interpret)
  shape = _tuned.shape_key(b * t, hd, v // tp, hidden.dtype)
  choice = _tuned.choose(impl, blocks, chunk_size, target, shape)
  impl, blocks, chunk_size = choice.impl, choice.blocks, choice.chunk_size
  mask, ids = args.mask, args.ids
  logps = dict(old_logps=args.old_logps, ref_logps=args.ref_logps, sampler_logps=args.sampler_logps)
  # Masked rows' hidden states (maybe NaN / inf) never reach the matmul; their gradient is exactly 0.
  hidden = jnp.where(mask[..., None], hidden, jnp.zeros((), hidden.dtype))
  if impl == "auto":
    impl = "xla" if target.platform == "cpu" else "chunked"
  if impl == "xla":
    loss, aux = fused_linear_grpo_loss_reference(
      hidden,
      lm_head,
      ids,
      mask,
      args.advantages,
      spec=spec,
      num_items_in_batch=num_items_in_batch,
      **logps,
    )
    return loss * scale, jax.tree.map(jax.lax.stop_gradient, aux)
  if impl == "pallas" and target.platform == "gpu":
    # The GPU's fused kernels are Mosaic GPU ones (a Triton program cannot hold the tiles; see
    # pallas.py); wgmma has no f32 path that meets the f32 tolerance, so f32 inputs take chunked.
    impl = "mosaic_gpu" if hidden.dtype.name in _mosaic.DTYPES else "chunked"

  n, vs = b * t, v // tp
  fused = None
  if impl == "mosaic_gpu":
    fused = _mosaic.make_config(target, blocks, n, hd, vs, hidden.dtype, spec.temperature)
  elif impl == "pallas":
    blocks = default_blocks(target, n, hd, vs) if blocks is None else blocks
    blocks.check(target, n, hd, vs)
    fused = _pallas.FusedConfig(target, blocks, vs, spec.temperature)
  chunk = default_chunk(n, vs) if chunk_size is None else chunk_size
  softmax = LossConfig(target, loss_blocks.default_blocks(target, chunk, vs), vs, spec.temperature)
  present = tuple(a is not None for a in logps.values())
  static = _Spec(impl, fused, softmax, chunk, mesh, vocab_axis, b, t, spec, present)
  placeholder = jnp.zeros((b, t), jnp.float32)  # a None log-prob array, told apart by `present`
  loss, aux = _loss(
    static,
    hidden.reshape(n, hd),
    lm_head,
    ids.reshape(n),
    mask,
    args.advantages,
    *(placeholder if a is None else a for a in logps.values()),
    num_items_in_batch,
    scale,
  )
  return loss, jax.tree.map(jax.lax.stop_gradient, aux)


# ------------------------------------------------------------------------------ the custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(static, h, w, ids, mask, adv, old, ref, sampler, num_items, scale):
  args = (h, w, ids, mask, adv, old, ref, sampler, num_items, scale)
  return _compute(static, *args, with_grads=False)[0]


def _loss_fwd(static, h, w, ids, mask, adv, old, ref, sampler, num_items, scale):
  args = (h, w, ids, mask, adv, old, ref, sampler, num_items, scale)
  return _compute(static, *args, with_grads=True)


def _loss_bwd(static, res, cts):
  dh, dw = res
  ct = cts[0]  # aux is data (the public op stop-gradients it)
  # ct is the constant 1 under jax.grad of the loss (loss_scale already rode in the weights): XLA
  # folds the multiply and the converts away, so there is no pass over dh / dw
  apply = lambda d: (ct * d.astype(jnp.float32)).astype(d.dtype)
  return apply(dh), apply(dw), None, None, None, None, None, None, None, None


_loss.defvjp(_loss_fwd, _loss_bwd)


def _given(static: _Spec, old, ref, sampler) -> dict:
  names = ("old_logps", "ref_logps", "sampler_logps")
  return {k: a if p else None for k, a, p in zip(names, (old, ref, sampler), static.present)}


def _compute(
  static: _Spec, h, w, ids, mask, adv, old, ref, sampler, num_items, scale, *, with_grads
):
  spec = static.loss
  b, t = static.batch, static.seq

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
    (lse, logp, entropy), dh, dw = _sharded(static, _local_one_pass, True, h, w, ids, tok)
  else:
    # the training path's Mosaic statistics pass may store exp(z - m) of the first columns for grads
    store = with_grads and static.impl == "mosaic_gpu" and static.mesh is None
    store = store and static.fused.blocks.stored_cols > 0
    local = functools.partial(_local_stats, store=store)
    (lse, logp, entropy), *stored = _sharded(static, local, False, h, w, ids, ())
  logp = logp.reshape(b, t)
  if with_grads and not one_pass:
    # a token's weight depends on its whole sequence: g = d loss / d logp from the [B, T] objective,
    # then the gradient pass over the vocabulary
    (loss, obj), dlogp = jax.value_and_grad(objective, has_aux=True)(logp)
    g = dlogp.reshape(-1) * (1.0 / spec.temperature)
    extra = (lse, g, *stored) if store else (lse, g)
    _, dh, dw = _sharded(static, _local_grads, True, h, w, ids, extra)
  else:
    loss, obj = objective(logp)
  aux = make_aux(mask, logp, entropy.reshape(b, t), obj)
  if not with_grads:
    return (loss, aux), None
  return (loss, aux), (dh.astype(h.dtype), dw.astype(w.dtype))


def _sharded(static: _Spec, local, with_grads: bool, h, w, ids, extra):
  """``local(static, h, w_shard, ids_local, *extra)`` -> ((lse, logp, entropy) | (), dh, dw), run on
  every vocabulary shard (shard_map) or on the whole vocabulary."""
  if static.mesh is None:
    return local(static, h, w, ids, *extra)
  rep, by_vocab = P(), P(None, static.axis)
  stats_out = () if local is _local_grads else (rep,) * 3
  return jax.shard_map(
    functools.partial(local, static),
    mesh=static.mesh,
    in_specs=(rep, by_vocab, rep, *((rep,) * len(extra))),
    out_specs=(stats_out, rep if with_grads else P(), by_vocab if with_grads else P()),
    check_vma=False,
  )(h, w, ids, *extra)


def _shard_ids(static: _Spec, w, ids):
  """ids relative to this vocabulary shard (outside [0, V_shard): another shard's token)."""
  return ids - jax.lax.axis_index(static.axis) * w.shape[1] if static.axis is not None else ids


def _combine(static: _Spec, lse_s, chosen_s, found_s, ez_s):
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


def _local_stats(static: _Spec, h, w, ids, store: bool = False):
  """The statistics pass: ((lse, logp, entropy), -, -), no gradients; with ``store`` (mosaic_gpu,
  one shard) ((lse, logp, entropy), pt, mt): the stored exp(z - m) for :func:`_local_grads`."""
  ids = _shard_ids(static, w, ids)
  if static.impl == "chunked":
    finish = lambda lse, chosen, found, ez, tok: (
      None,
      None,
      _combine(static, lse, chosen, found, ez),
    )
    stats, _, _ = _chunked.run(static.softmax, static.chunk, h, w, ids, (), finish, False)
  elif store:
    partials, (pt, mt) = _mosaic.stats(static.fused, h, w, ids, store=True)
    return _combine(static, *partials), pt, mt
  else:
    kernel = _mosaic.stats if static.impl == "mosaic_gpu" else _pallas.stats
    stats = _combine(static, *kernel(static.fused, h, w, ids))
  empty = jnp.zeros((0,), jnp.float32)  # per call: a module-level array would start the backend
  return stats, empty, empty


def _local_grads(static: _Spec, h, w, ids, lse, g, *stored):
  """The gradient pass for known global lse [n] and g = d loss / d z_chosen [n]: ((), dh, dw);
  ``stored``: :func:`_local_stats`'s (pt, mt), whose columns' dl needs no recomputed logits."""
  ids = _shard_ids(static, w, ids)
  if static.impl == "chunked":
    dh, dw = _chunked.run_grads(static.softmax, static.chunk, h, w, ids, lse, g)
  else:
    # Whole-vocabulary gradients are final: store them in the input dtypes; shards' dh parts sum in f32.
    dtype = jnp.float32 if static.axis else h.dtype
    if static.impl == "mosaic_gpu":
      dh, dw = _mosaic.grads(static.fused, h, w, ids, lse, g, dtype, w.dtype, stored or None)
    else:
      dh, dw = _pallas.grads(static.fused, h, w, ids, lse, g, dtype, w.dtype)
  if static.axis is not None:
    dh = jax.lax.psum(dh, static.axis)
  return (), dh, dw


def _local_one_pass(static: _Spec, h, w, ids, mask, adv, old, ref, sampler, weights):
  """Chunked, token-level options: statistics, each token's g and the gradients in one pass."""
  spec = static.loss

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

  tok = (mask, adv, old, ref, sampler, weights)
  ids = _shard_ids(static, w, ids)
  stats, dh, dw = _chunked.run(static.softmax, static.chunk, h, w, ids, tok, finish, True)
  if static.axis is not None:
    dh = jax.lax.psum(dh, static.axis)
  return stats, dh, dw
