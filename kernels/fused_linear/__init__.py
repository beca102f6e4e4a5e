"""``fused_linear_grpo_loss``: the GRPO loss fused with the LM head, so [tokens x vocab] logits never
reach memory whole — optionally with the vocabulary sharded over a mesh axis (tensor parallelism)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kernels import backend, checks, loss_spec
from kernels.fused_linear.chunked_blocks import ChunkBlocks, default_chunk
from kernels.fused_linear.impls import IMPLEMENTATIONS, OP, Call, shape_key
from kernels.fused_linear.mosaic_gpu_blocks import MosaicLinearBlocks
from kernels.fused_linear.pallas_blocks import LinearBlocks, default_blocks
from kernels.fused_linear.reference import fused_linear_grpo_loss_reference, vocab_stats_reference
from kernels.grpo_loss.args import validate_loss_args
from kernels.grpo_loss.reference import GRPOAux
from kernels.loss_spec import LossSpec
from kernels.sharding import KernelSharding, local_batch

__all__ = [
  "IMPLEMENTATIONS",
  "IMPLS",
  "OP",
  "ChunkBlocks",
  "LinearBlocks",
  "MosaicLinearBlocks",
  "default_blocks",
  "default_chunk",
  "fused_linear_grpo_loss",
  "fused_linear_grpo_loss_reference",
  "vocab_stats_reference",
]

# ("auto", "pallas", "mosaic_gpu", "chunked", "xla"): the table's, for callers that list them
IMPLS = OP.choices


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
  support_gap=None,  # [B, T] f32 <= 0 or None: score each token over its sampled support
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
  sharding: KernelSharding | None = None,  # B's and V's mesh axes: the kernels run shard-local
  **spec_fields,  # LossSpec fields as keywords (beta=..., loss_type=...); with spec= they must agree
) -> tuple[jax.Array, GRPOAux]:
  """``kernels.grpo_loss(hidden @ lm_head, ...)`` without the [B, T, V] logits; differentiable w.r.t.
  ``hidden`` and ``lm_head``. Same loss, ``aux``, input checks and jit behaviour as
  :func:`kernels.grpo_loss` (logits accumulated in f32); ``hidden`` at masked positions may be NaN /
  inf (replaced by 0 before the matmul). ``aux`` carries no gradient, in every impl.

  Args:
    impl: ``"pallas"``: the fully fused kernels (TPU / CPU interpreter; O(tile) memory, 8 N·H·V flops (10 on megacore v4 / v5p);
      on GPU ``mosaic_gpu`` for bf16 / f16, else ``chunked``). ``"mosaic_gpu"``: the Hopper kernels
      (bf16 / f16; 8 N·H·V flops). ``"chunked"``: XLA matmuls per token chunk + grpo_loss's softmax
      kernels (one f32 [chunk, V] buffer, 6 N·H·V flops). ``"xla"``: the reference. ``"auto"``: the
      tuned cache's winner (:mod:`.impls`), else ``xla`` on CPU, ``chunked`` on GPU and TPU.
    blocks, chunk_size: tiles of the ``pallas`` (``LinearBlocks``) or ``mosaic_gpu``
      (``MosaicLinearBlocks``) path and tokens per chunk of the ``chunked`` path.
    sharding: e.g. ``KernelSharding(mesh, batch_axes=("dp", "fsdp"), vocab_axis="tp")``: B over
      the batch axes, lm_head's V over ``vocab_axis`` (each must divide evenly). The kernels run
      shard-local in one ``shard_map`` (V shards' statistics combined, dhidden summed over them,
      dlm_head over the B shards); the loss's reductions stay on the whole arrays, so results equal
      the unsharded call's. ``mesh`` / ``vocab_axis``: the older spelling of
      ``KernelSharding(mesh, vocab_axis=...)`` (not with ``sharding``).
    support_gap: as in :func:`kernels.grpo_loss` (:mod:`kernels.support`), in every impl: the fused
      kernels gather each row's chosen logit z'_y first (an [N, H] gather of the head's columns)
      and apply the threshold z'_y + gap to every logits tile of every sweep (:mod:`.gap`).
    loss_scale: multiplies the loss (a micro-batch's share), folded into each token's weight before
      the in-forward gradients, as in :func:`kernels.grpo_loss`. aux is not scaled.

  Raises:
    ValueError: everything ``grpo_loss`` rejects (:func:`kernels.grpo_loss.args.validate_loss_args`),
      H or dtype mismatches between ``hidden`` and ``lm_head``, a non-floating dtype, an unknown
      ``impl``, ``impl="mosaic_gpu"`` with f32 or on TPU or with illegal ``MosaicLinearBlocks``, a
      vocabulary the axis does not divide, ``chunk_size`` <= 0, a non-finite ``loss_scale``.
    TypeError: ``impl="mosaic_gpu"`` with ``blocks`` that are not ``MosaicLinearBlocks``; a
      ``loss_scale`` that is not a numeric scalar.
  """
  OP.check(impl)
  spec = loss_spec.resolve(spec, **spec_fields)
  hidden, lm_head = _check_head(hidden, lm_head)
  (b, t, hd), v = hidden.shape, lm_head.shape[1]
  logps = dict(old_logps=old_logps, ref_logps=ref_logps, sampler_logps=sampler_logps, support_gap=support_gap)  # fmt: skip
  logits = jax.ShapeDtypeStruct((b, t, v), hidden.dtype)
  args = validate_loss_args(logits, completion_ids, completion_mask, advantages, **logps, spec=spec, num_items_in_batch=num_items_in_batch)  # fmt: skip
  checks.positive_int("chunk_size", chunk_size, allow_none=True)
  sharding = _sharding(sharding, mesh, vocab_axis, v)
  tp = 1 if sharding is None else sharding.axis_size(sharding.vocab_axis)
  n = local_batch(sharding, "hidden", b) * t  # a kernel's rows: one shard's
  scale = checks.loss_scale(loss_scale)
  scale = jnp.float32(1.0) if scale is None else scale
  target = backend.resolve(platform, interpret)
  shape = shape_key(n, hd, v // tp, hidden.dtype)
  resolve = lambda i, tiles: OP.resolve(i, tiles, target, shape)
  impl, blocks, chunk_size = _choose(impl, blocks, chunk_size, resolve)
  # Masked rows' hidden states (maybe NaN / inf) never reach the matmul; their gradient is exactly 0.
  hidden = jnp.where(args.mask[..., None], hidden, jnp.zeros((), hidden.dtype))
  call = Call(hidden, lm_head, args, spec, num_items_in_batch, scale, target, blocks, chunk_size, sharding, shape)  # fmt: skip
  return OP[impl].run(call)


def _choose(impl: str, blocks, chunk_size, resolve):
  """(impl, blocks, chunk_size) after ``resolve(impl, tiles)`` (the call's: ``OP.resolve``, the tuned
  cache's winner or the caller's; ``auto`` without an entry: xla on CPU, else chunked). The caller's
  ``chunk_size`` is its ``ChunkBlocks`` (given tiles stay given)."""
  tiles = blocks
  if tiles is None and chunk_size is not None:
    tiles = ChunkBlocks(chunk_size)
  t_impl, t_tiles = resolve(impl, tiles)
  if t_tiles is tiles:  # nothing tuned: the caller's own tiles
    return t_impl, blocks, chunk_size
  if isinstance(t_tiles, ChunkBlocks):
    return t_impl, None, t_tiles.chunk_size
  return t_impl, t_tiles, chunk_size


def _check_head(hidden, lm_head):
  """hidden [B, T, H] floating and lm_head [H, V] of the same dtype, as jax arrays."""
  hidden, lm_head = checks.as_array("hidden", hidden), checks.as_array("lm_head", lm_head)
  checks.ndim_array("hidden", hidden, 3, "[B, T, H]")
  checks.ndim_array("lm_head", lm_head, 2, "[H, V]")
  checks.dtype_kind("hidden", hidden, "floating")
  hd = hidden.shape[2]
  if lm_head.shape[0] != hd:
    raise ValueError(
      f"hidden size mismatch: hidden is [B, T, {hd}] but lm_head is {lm_head.shape} (expected "
      f"[{hd}, V]; a [V, H] embedding matrix must be transposed)"
    )
  if hidden.dtype != lm_head.dtype:
    raise ValueError(
      f"hidden ({hidden.dtype}) and lm_head ({lm_head.dtype}) must have the same dtype"
    )
  return hidden, lm_head


def _sharding(sharding, mesh: Mesh | None, vocab_axis: str | None, v: int):
  """The call's KernelSharding (``mesh`` / ``vocab_axis`` are its older spelling), checked against
  V; ValueError for an axis the mesh lacks or one that does not divide V."""
  if (mesh is None) != (vocab_axis is None):
    raise ValueError("pass mesh and vocab_axis together (or neither)")
  if mesh is not None:
    if sharding is not None:
      raise ValueError("pass sharding= or mesh= / vocab_axis=, not both")
    if vocab_axis not in mesh.axis_names:
      raise ValueError(f"vocab_axis {vocab_axis!r} is not an axis of the mesh {mesh.axis_names}")
    sharding = KernelSharding(mesh, vocab_axis=vocab_axis)
  if sharding is not None:
    sharding.check_axis("vocab_axis", "V", v)
  return sharding
