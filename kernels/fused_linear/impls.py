"""``fused_linear_grpo_loss``'s implementations: the op's one table (:class:`kernels.ops.Op`), and
how the public function calls each (``Impl.run(call)``).

  xla         the reference (:mod:`.reference`): logits materialised, accumulated in f32
  pallas      the fully fused Pallas kernels (:mod:`.pallas_tpu`; TPU / CPU interpreter: O(tile)
              memory, 8 N·H·V flops where one gradient kernel runs, 10 on megacore chips); on GPU the Mosaic GPU kernels for bf16 / f16 and the chunked
              path for f32; blocks ``LinearBlocks`` (``MosaicLinearBlocks`` on GPU)
  mosaic_gpu  the Hopper kernels (:mod:`.mosaic_gpu`; bf16 / f16, 8 N·H·V flops); ``MosaicLinearBlocks``
  chunked     XLA matmuls per token chunk + grpo_loss's softmax kernels (:mod:`.chunked`; one f32
              [chunk, V] buffer, 6 N·H·V flops); its tile ``ChunkBlocks`` is the ``chunk_size=``

``impl="auto"``: the tuned cache's choice, else xla on CPU and chunked on GPU and TPU. Every kernel
impl runs under one custom VJP (:mod:`.vjp`), shard-local under a sharding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kernels import ops
from kernels.backend import Target
from kernels.fused_linear import (
  chunked,
  chunked_blocks,
  mosaic_gpu,
  mosaic_gpu_blocks,
  pallas_blocks,
  pallas_tpu,
  reference,
  vjp,
)
from kernels.grpo_loss import pallas_blocks as loss_blocks
from kernels.grpo_loss.args import LOGPS, LossArgs
from kernels.loss_spec import LossSpec
from kernels.sharding import KernelSharding


@dataclasses.dataclass(frozen=True)
class Call:
  """One validated call of ``fused_linear_grpo_loss`` (masked rows' hidden states zeroed)."""

  hidden: jax.Array  # [B, T, H]
  lm_head: jax.Array  # [H, V]
  args: LossArgs  # logits: a [B, T, V] ShapeDtypeStruct
  spec: LossSpec
  num_items_in_batch: Any
  scale: Any  # f32 scalar (may be traced)
  target: Target
  blocks: Any  # LinearBlocks / MosaicLinearBlocks or None (the heuristic)
  chunk_size: int | None
  sharding: KernelSharding | None
  shape: dict  # the tuner's dict: dtype, tokens (one shard's), hidden, vocab (one shard's)


def shape_key(n: int, h: int, v: int, dtype) -> dict:
  """The tuner's shape dict; v: the vocabulary one kernel call sees (one shard's under tensor
  parallelism)."""
  return dict(dtype=jnp.dtype(dtype).name, tokens=n, hidden=h, vocab=v)


def _run_reference(call: Call):
  a = call.args
  logps = {name: getattr(a, name) for name in LOGPS}  # validated: 0 at masked positions
  loss, aux = reference.fused_linear_grpo_loss_reference(
    call.hidden, call.lm_head, a.ids, a.mask, a.advantages, spec=call.spec, num_items_in_batch=call.num_items_in_batch, support_gap=a.support_gap, **logps
  )  # fmt: skip
  return loss * call.scale, jax.tree.map(jax.lax.stop_gradient, aux)


def _pallas_fused(call: Call):
  """("pallas", its FusedConfig) off GPU; on GPU the Mosaic GPU kernels (a Triton program cannot hold
  the tiles, see pallas_tpu.py) for bf16 / f16, and chunked for f32 (wgmma has no f32 path that
  meets the f32 tolerance)."""
  s, target = call.shape, call.target
  if target.platform == "gpu":
    return _mosaic_fused(call) if s["dtype"] in mosaic_gpu_blocks.DTYPES else ("chunked", None)
  blocks = call.blocks or _pallas_heuristic(target, s)
  reason = pallas_blocks.legal_on(target, blocks, s)
  if reason:  # tiles that cannot compile here: refused before anything compiles
    raise ValueError(f"fused_linear_grpo_loss(impl='pallas'): {reason}")
  return "pallas", pallas_tpu.FusedConfig(target, blocks, s["vocab"], call.spec.temperature)


def _mosaic_fused(call: Call):
  s = call.shape
  cfg = mosaic_gpu.make_config(call.target, call.blocks, s["tokens"], s["hidden"], s["vocab"], s["dtype"], call.spec.temperature)  # fmt: skip
  return "mosaic_gpu", cfg


def _run_kernel(call: Call, *, fused):
  """A kernel impl under the custom VJP (:mod:`.vjp`) on flattened tokens: ``fused(call)`` is (the
  impl that runs, its fused kernels' config or None for chunked); aux is data (no gradient)."""
  impl, cfg = fused(call)
  s, a = call.shape, call.args
  b, t, hd = call.hidden.shape
  chunk = call.chunk_size or chunked_blocks.default_chunk(s["tokens"], s["vocab"])
  softmax_blocks = loss_blocks.default_blocks(call.target, chunk, s["vocab"])
  softmax = loss_blocks.LossConfig(call.target, softmax_blocks, s["vocab"], call.spec.temperature)
  present = tuple(getattr(a, name) is not None for name in LOGPS)
  sh = call.sharding
  mesh, axis = (None, None) if sh is None else (sh.mesh, sh.vocab_axis)
  rows = () if sh is None else sh.batch_axes
  gapped = a.support_gap is not None
  static = vjp.Static(impl, cfg, softmax, chunk, mesh, axis, b, t, call.spec, present, rows, gapped)
  placeholder = jnp.zeros((b, t), jnp.float32)  # a None log-prob array, told apart by `present`
  logps = (getattr(a, name) for name in LOGPS)
  gap = a.support_gap.reshape(b * t) if gapped else jnp.zeros((b * t,), jnp.float32)
  loss, aux = vjp.fused_loss(
    static,
    call.hidden.reshape(b * t, hd),
    call.lm_head,
    a.ids.reshape(b * t),
    a.mask,
    a.advantages,
    *(placeholder if x is None else x for x in logps),
    gap,
    call.num_items_in_batch,
    call.scale,
  )
  return loss, jax.tree.map(jax.lax.stop_gradient, aux)


def _pallas_heuristic(target: Target, s: dict):
  n, h, v = s["tokens"], s["hidden"], s["vocab"]
  if target.platform == "gpu":  # pallas means the Mosaic GPU kernels there (bf16 / f16)
    return mosaic_gpu_blocks.default_blocks(n, h, v) if s["dtype"] in mosaic_gpu_blocks.DTYPES else None  # fmt: skip
  return pallas_blocks.default_blocks(target, n, h, v, jnp.dtype(s["dtype"]).itemsize)


def _pallas_supported_on(target: Target, s: dict, blocks) -> str | None:
  """Off GPU: :func:`.pallas_blocks.legal_on`; on GPU the Mosaic GPU blocks' check (bf16 / f16)."""
  if target.platform == "gpu":
    if s["dtype"] not in mosaic_gpu_blocks.DTYPES:
      return None if blocks is None else f"pallas on GPU takes no blocks for {s['dtype']} (chunked)"
    return _mosaic_supported_on(target, s, blocks)
  blocks = blocks or _pallas_heuristic(target, s)
  if not isinstance(blocks, pallas_blocks.LinearBlocks):
    return f"pallas takes LinearBlocks off GPU, got {blocks!r}"
  return pallas_blocks.legal_on(target, blocks, s)


def _mosaic_heuristic(target: Target, s: dict):
  return mosaic_gpu_blocks.default_blocks(s["tokens"], s["hidden"], s["vocab"])


def _chunked_heuristic(target: Target, s: dict):
  return chunked_blocks.ChunkBlocks(chunked_blocks.default_chunk(s["tokens"], s["vocab"]))


def _mosaic_supported_on(target: Target, s: dict, blocks) -> str | None:
  blocks = blocks or _mosaic_heuristic(target, s)
  if not isinstance(blocks, mosaic_gpu_blocks.MosaicLinearBlocks):
    return f"mosaic_gpu takes MosaicLinearBlocks, got {blocks!r}"
  try:
    blocks.check(s["hidden"], s["dtype"])
  except ValueError as e:
    return str(e)
  return None


def bucket(s: dict) -> str:
  """The tuning cache's key: tokens rounded up to a power of two; hidden and vocabulary exact."""
  return f"{s['dtype']}/n{ops.pow2(s['tokens'])}/h{s['hidden']}/v{s['vocab']}"


IMPLEMENTATIONS = {
  "pallas": ops.Impl(
    modules=(pallas_tpu, mosaic_gpu),
    blocks=(pallas_blocks.LinearBlocks, mosaic_gpu_blocks.MosaicLinearBlocks),
    heuristic=_pallas_heuristic,
    candidates=lambda s, platform: [] if platform == "gpu" else [None],  # GPU: see mosaic_gpu
    supported_on=_pallas_supported_on,
    run=lambda call: _run_kernel(call, fused=_pallas_fused),
  ),
  "mosaic_gpu": ops.Impl(
    modules=(mosaic_gpu,),
    blocks=(mosaic_gpu_blocks.MosaicLinearBlocks,),
    platforms=("gpu",),
    heuristic=_mosaic_heuristic,
    candidates=mosaic_gpu_blocks.candidate_blocks,
    supported_on=_mosaic_supported_on,
    run=lambda call: _run_kernel(call, fused=_mosaic_fused),
  ),
  "chunked": ops.Impl(
    modules=(chunked,),
    blocks=(chunked_blocks.ChunkBlocks,),
    heuristic=_chunked_heuristic,
    candidates=chunked_blocks.candidate_blocks,
    run=lambda call: _run_kernel(call, fused=lambda c: ("chunked", None)),
  ),
  "xla": ops.Impl(modules=(reference,), run=_run_reference),
}

OP = ops.Op(
  "fused_linear",
  IMPLEMENTATIONS,
  bucket,
  auto=dict(cpu="xla", gpu="chunked", tpu="chunked"),
  tuning_order=("xla", "chunked", "pallas", "mosaic_gpu"),  # the cheap chunk sizes first
)
