"""``fused_linear_grpo_loss``: the GRPO loss fused with the LM head, so [tokens x vocab] logits never
reach memory whole — optionally with the vocabulary sharded over a mesh axis (tensor parallelism)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels import backend, checks
from kernels.fused_linear import chunked as _chunked
from kernels.fused_linear import pallas as _pallas
from kernels.fused_linear.blocks import LinearBlocks, default_blocks, default_chunk
from kernels.fused_linear.reference import fused_linear_grpo_loss_reference, vocab_stats_reference
from kernels.grpo_loss import blocks as loss_blocks
from kernels.grpo_loss import validate_loss_args
from kernels.grpo_loss.pallas import LossConfig, token_terms
from kernels.grpo_loss.reference import DEFAULT_MAX_LOG_RATIO, GRPOAux, make_aux, reduce_loss

__all__ = [
  "IMPLS",
  "LinearBlocks",
  "default_blocks",
  "default_chunk",
  "fused_linear_grpo_loss",
  "fused_linear_grpo_loss_reference",
  "vocab_stats_reference",
]

IMPLS = ("auto", "pallas", "chunked", "xla")


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one call (hashable: it is a custom_vjp non-differentiable argument)."""

  impl: str  # "pallas" | "chunked"
  fused: _pallas.FusedConfig | None
  loss: LossConfig  # the grpo_loss kernels' config (chunked) and the loss-term settings (both)
  chunk: int
  mesh: Mesh | None
  axis: str | None
  batch: int
  seq: int
  loss_type: str
  max_completion_length: int | None


def fused_linear_grpo_loss(
  hidden,  # [B, T, H] bf16/f32: final-norm hidden states at the positions scoring completion_ids
  lm_head,  # [H, V], same dtype as hidden
  completion_ids,  # [B, T] int
  completion_mask,  # [B, T] 0/1
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
  num_items_in_batch=None,
  max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO,
  impl: str = "auto",
  platform: backend.Platform | None = None,
  interpret: bool | None = None,
  blocks: LinearBlocks | None = None,
  chunk_size: int | None = None,
  mesh: Mesh | None = None,
  vocab_axis: str | None = None,
) -> tuple[jax.Array, GRPOAux]:
  """``kernels.grpo_loss(hidden @ lm_head, ...)`` without the [B, T, V] logits; differentiable w.r.t.
  ``hidden`` and ``lm_head``.

  Same loss, ``aux``, keyword semantics (``max_log_ratio`` included), input checks and jit behaviour
  as :func:`kernels.grpo_loss` (logits are accumulated in f32). ``hidden`` at masked positions may be
  NaN / inf: it is replaced by 0 before the matmul, so it reaches neither the loss nor ``dhidden`` /
  ``dlm_head``.
  The gradients are computed during the forward pass (the loss weights of every token are known before
  the vocabulary is seen) and scaled by the loss cotangent in the backward pass, so the logits are
  formed once (``chunked``) or recomputed tile by tile (``pallas``) — never stored. ``aux`` is data:
  it carries no gradient, in every impl (``xla`` included).

  Args:
    impl: ``"pallas"``: the fully fused kernels (TPU / CPU interpreter; O(tile) memory, 10 N·H·V flops).
      ``"chunked"``: XLA matmuls per token chunk + grpo_loss's Pallas softmax kernels (every backend;
      one f32 [chunk, V] buffer, 6 N·H·V flops). ``"xla"``: the reference, materialising the logits.
      ``"auto"``: ``xla`` on CPU (the interpreter is a correctness tool), ``chunked`` on GPU (no fused
      Triton variant: see ``kernels/fused_linear/pallas.py``) and on TPU (fewer flops; ``pallas`` when
      memory matters more — neither has been timed on a TPU yet).
    blocks, chunk_size: tiles of the ``pallas`` path and tokens per chunk of the ``chunked`` path.
    mesh, vocab_axis: tensor parallelism. ``lm_head`` is split over its vocabulary on mesh axis
      ``vocab_axis`` (``shard_map``): each shard computes its partial max / sum-exp / chosen logit,
      combined across the axis before the loss, and its own slice of the LM-head gradient. The other
      arguments are replicated.

  Raises:
    ValueError: everything ``grpo_loss`` rejects (:func:`kernels.grpo_loss.validate_loss_args`), and
      H or dtype mismatches between ``hidden`` and ``lm_head``, a non-floating dtype, an unknown
      ``impl``, ``impl="pallas"`` on GPU, a vocabulary the axis does not divide, ``chunk_size`` <= 0.
  """
  checks.choice("impl", impl, IMPLS)
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
    beta=beta,
    epsilon_low=epsilon_low,
    epsilon_high=epsilon_high,
    temperature=temperature,
    loss_type=loss_type,
    max_completion_length=max_completion_length,
    num_items_in_batch=num_items_in_batch,
    max_log_ratio=max_log_ratio,
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

  target = backend.resolve(platform, interpret)
  mask, ids, old_logps, ref_logps = args.mask, args.ids, args.old_logps, args.ref_logps
  # Masked rows' hidden states (maybe NaN / inf) never reach the matmul; their gradient is exactly 0.
  hidden = jnp.where(mask[..., None], hidden, jnp.zeros((), hidden.dtype))
  reduce_kw = dict(
    loss_type=loss_type,
    max_completion_length=max_completion_length,
    num_items_in_batch=num_items_in_batch,
  )
  if impl == "auto":
    impl = "xla" if target.platform == "cpu" else "chunked"
  if impl == "xla":
    loss, aux = fused_linear_grpo_loss_reference(
      hidden,
      lm_head,
      ids,
      mask,
      args.advantages,
      old_logps=old_logps,
      ref_logps=ref_logps,
      **args.options,
      **reduce_kw,
    )
    return loss, jax.tree.map(jax.lax.stop_gradient, aux)
  if impl == "pallas" and target.family == "rowloop":
    raise ValueError(
      "impl='pallas' (the fully fused kernels) needs grid-axis accumulation, which GPU "
      "programs lack; use impl='chunked' on GPU"
    )

  n, vs = b * t, v // tp
  fused = None
  if impl == "pallas":
    blocks = default_blocks(target, n, hd, vs) if blocks is None else blocks
    blocks.check(target, n, hd, vs)
    fused = _pallas.FusedConfig(target, blocks, vs, float(temperature))
  chunk = default_chunk(n, vs) if chunk_size is None else chunk_size
  loss_cfg = LossConfig(
    target=target,
    blocks=loss_blocks.default_blocks(target, chunk, vs),
    vocab=vs,
    on_policy=old_logps is None,
    **args.options,
  )
  spec = _Spec(
    impl, fused, loss_cfg, chunk, mesh, vocab_axis, b, t, loss_type, max_completion_length
  )
  zeros = jnp.zeros((n,), jnp.float32)
  flat = lambda a: zeros if a is None else a.reshape(n)
  loss, (kl, logp, entropy, clipped) = _loss(
    spec,
    hidden.reshape(n, hd),
    lm_head,
    ids.reshape(n),
    mask,
    flat(old_logps),
    flat(ref_logps),
    flat(jnp.broadcast_to(args.advantages[:, None], (b, t))),
    num_items_in_batch,
  )
  shaped = lambda a: jax.lax.stop_gradient(a).reshape(b, t)
  return loss, make_aux(mask, shaped(logp), shaped(entropy), shaped(clipped) > 0, shaped(kl))


# ------------------------------------------------------------------------------ the custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(spec, h, w, ids, mask, old, ref, adv, num_items):
  return _compute(spec, h, w, ids, mask, old, ref, adv, num_items, with_grads=False)[0]


def _loss_fwd(spec, h, w, ids, mask, old, ref, adv, num_items):
  return _compute(spec, h, w, ids, mask, old, ref, adv, num_items, with_grads=True)


def _loss_bwd(spec, res, cts):
  dh, dw = res
  ct = cts[0]  # aux is data (the public op stop-gradients it)
  scale = lambda d: (ct * d.astype(jnp.float32)).astype(d.dtype)
  return scale(dh), scale(dw), None, None, None, None, None, None


_loss.defvjp(_loss_fwd, _loss_bwd)


def _compute(spec, h, w, ids, mask, old, ref, adv, num_items, *, with_grads: bool):
  reduce = functools.partial(
    reduce_loss,
    mask=mask,
    loss_type=spec.loss_type,
    max_completion_length=spec.max_completion_length,
    num_items_in_batch=num_items,
  )
  # The reduction is linear in the per-token loss: its gradient is each token's weight in the loss.
  weights = jax.grad(lambda pt: reduce(pt))(jnp.zeros((spec.batch, spec.seq), jnp.float32)).reshape(
    -1
  )
  local = functools.partial(_local, spec, with_grads)
  if spec.mesh is None:
    outs, dh, dw = local(h, w, ids, weights, old, ref, adv)
  else:
    rep, by_vocab = P(), P(None, spec.axis)
    outs, dh, dw = jax.shard_map(
      local,
      mesh=spec.mesh,
      in_specs=(rep, by_vocab, rep, rep, rep, rep, rep),
      out_specs=((rep,) * 5, rep if with_grads else P(), by_vocab if with_grads else P()),
      check_vma=False,
    )(h, w, ids, weights, old, ref, adv)
  per_token, kl, logp, entropy, clipped = outs
  loss = reduce(per_token.reshape(spec.batch, spec.seq))
  residuals = (dh.astype(h.dtype), dw.astype(w.dtype)) if with_grads else None
  return (loss, (kl, logp, entropy, clipped)), residuals


def _local(spec: _Spec, with_grads: bool, h, w, ids, weights, old, ref, adv):
  """One vocabulary shard (or the whole vocabulary): per-token outputs, dh (summed over shards), dw.

  Without ``with_grads`` only the statistics pass runs, and dh / dw are empty placeholders.
  """
  vs = w.shape[1]
  axis = spec.axis
  ids_local = ids - jax.lax.axis_index(axis) * vs if axis is not None else ids

  def finish(lse_s, chosen_s, found_s, ez_s, tok):
    """Combine the shards' statistics, then the per-token loss and g = d loss / d z_chosen."""
    old_c, ref_c, adv_c, w_c = tok
    if axis is None:
      lse, chosen, found, ez = lse_s, chosen_s, found_s, ez_s
    else:
      top = jax.lax.pmax(lse_s, axis)
      lse = top + jnp.log(jax.lax.psum(jnp.exp(lse_s - top), axis))
      chosen, found = jax.lax.psum(chosen_s, axis), jax.lax.psum(found_s, axis)
      ez = jax.lax.psum(jnp.exp(lse_s - lse) * ez_s, axis)
    logp = jnp.where(found > 0, chosen - lse, jnp.nan)  # an id outside [0, V) poisons, never hides
    per_token, kl, clipped, dpt, _ = token_terms(logp, old_c, ref_c, adv_c, spec.loss)
    g = w_c * dpt * (1.0 / spec.loss.temperature)
    return lse, g, (per_token, kl, logp, lse - ez, clipped)

  tok = (old, ref, adv, weights)
  empty = jnp.zeros((0,), jnp.float32)
  if spec.impl == "chunked":
    outs, dh, dw = _chunked.run(spec.loss, spec.chunk, h, w, ids_local, tok, finish, with_grads)
  else:
    lse, g, outs = finish(*_pallas.stats(spec.fused, h, w, ids_local), tok)
    if not with_grads:
      return outs, empty, empty
    # Whole-vocabulary gradients are final: store them in the input dtypes; shards' dh parts sum in f32.
    dh, dw = _pallas.grads(
      spec.fused, h, w, ids_local, lse, g, jnp.float32 if axis else h.dtype, w.dtype
    )
  if not with_grads:
    return outs, empty, empty
  if axis is not None:
    dh = jax.lax.psum(dh, axis)
  return outs, dh, dw
