"""``grpo_loss``'s implementations: the op's one table (:class:`kernels.ops.Op`), and how the public
function calls each (``Impl.run(call)``; the formulas: :mod:`kernels.grpo_loss`).

  xla         the pure-JAX reference (:mod:`.reference`)
  pallas      the Pallas kernels (:mod:`.pallas`): Mosaic TPU / its CPU interpreter
              (:mod:`.pallas_tpu`), Triton on GPU (:mod:`.pallas_triton`); blocks ``LossBlocks``
  mosaic_gpu  the Hopper kernels (:mod:`.mosaic_gpu`, :mod:`.mosaic_gpu_cluster`,
              :mod:`.mosaic_gpu_train`); blocks ``MosaicLossBlocks`` or ``ClusterLossBlocks``

``impl="auto"``: the tuned cache's choice, else xla on CPU (the interpreter is a correctness tool)
and pallas on GPU and TPU. The kernel impls run the two-pass training path (:mod:`.vjp`) for
token-level specs and the three-pass one (statistics, [B, T] objective, backward) for sequence-level
ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from kernels import ops
from kernels.backend import Target
from kernels.grpo_loss import (
  mosaic_gpu,
  mosaic_gpu_blocks,
  mosaic_gpu_cluster,
  mosaic_gpu_train,
  pallas,
  pallas_blocks,
  pallas_tpu,
  pallas_triton,
  reference,
  train,
  vjp,
)
from kernels.grpo_loss.args import LossArgs
from kernels.loss_spec import LossSpec
from kernels.objective import policy_objective
from kernels.sharding import KernelSharding, shard_rows


@dataclasses.dataclass(frozen=True)
class Call:
  """One validated call of ``grpo_loss``: what an impl's ``run`` needs."""

  args: LossArgs
  spec: LossSpec
  num_items_in_batch: Any  # scalar (may be traced) or None
  target: Target
  blocks: Any  # the impl's blocks (None: its heuristic)
  reuse_logits_buffer: bool
  scale: Any  # the loss scale (may be traced) or None
  sharding: KernelSharding | None
  rows: int  # a kernel's rows: one shard's B x T


def _threshold(call: Call):  # -> [N] f32 or None
  """Each flat token's support threshold for the kernels' sweeps (:func:`pallas.threshold`: one
  gather of N chosen logits in XLA); None without a gap (the kernels as without one)."""
  a = call.args
  if a.support_gap is None:
    return None
  b, t, v = a.logits.shape
  x, ids = a.logits.reshape(b * t, v), a.ids.reshape(b * t)
  return pallas.threshold(x, ids, a.support_gap.reshape(b * t), call.spec.temperature)


def _logps(args: LossArgs) -> dict:
  return dict(old_logps=args.old_logps, ref_logps=args.ref_logps, sampler_logps=args.sampler_logps)


def _run_reference(call: Call):
  a = call.args
  loss, aux = reference.grpo_loss_reference(
    a.logits, a.ids, a.mask, a.advantages, **_logps(a), support_gap=a.support_gap, spec=call.spec, num_items_in_batch=call.num_items_in_batch
  )  # fmt: skip
  return (loss if call.scale is None else loss * call.scale), aux


def _pallas_config(call: Call) -> pallas_blocks.LossConfig:
  """The Pallas kernels' config for the call's rows (blocks checked by ``supported_on``)."""
  v = call.args.logits.shape[2]
  blocks = call.blocks or pallas_blocks.default_blocks(
    call.target, call.rows, v, call.args.logits.dtype
  )
  return pallas_blocks.LossConfig(call.target, blocks, v, call.spec.temperature, call.reuse_logits_buffer)  # fmt: skip


def _mosaic_config(call: Call) -> mosaic_gpu_blocks.MosaicLossConfig:
  b, t, v = call.args.logits.shape
  return mosaic_gpu.make_config(
    call.args.logits.reshape(b * t, v),
    target=call.target,
    blocks=call.blocks,
    temperature=call.spec.temperature,
    reuse_logits_buffer=call.reuse_logits_buffer,
  )


def _run_kernel(call: Call, *, config, token_logps):
  """A kernel impl: ``config(call)`` is its static config, ``token_logps(cfg, x, ids)`` its
  three-pass (logp, entropy); the training path is :mod:`.vjp`'s for every kernel impl. With a
  support gap every kernel gaps its own sweeps by the rows' thresholds (:func:`_threshold`)."""
  cfg = config(call)
  thr = _threshold(call)
  if call.spec.sequence_level:
    loss, aux = _sequence_level(call, cfg, token_logps, thr)
    return (loss if call.scale is None else loss * call.scale), aux
  return _token_level(call, cfg, thr)


def _token_level(call: Call, kernel_cfg, thr):
  """The two-pass training path (:mod:`kernels.grpo_loss.vjp`): a token's loss weight is a function
  of its own log p, so the forward writes dlogits in the same pass."""
  args, spec = call.args, call.spec
  b, t, v = args.logits.shape
  data = dict(
    mask=args.mask,
    advantages=args.advantages,
    **_logps(args),
    num_items_in_batch=call.num_items_in_batch,
    scale=call.scale,
    thr=thr,
  )
  present = tuple(k for k in train.TOKEN_FIELDS[3:] if data[k] is not None)
  cfg = train.TrainConfig(kernel_cfg, spec, train.TOKEN_FIELDS[:3] + present)
  x, ids = args.logits.reshape(b * t, v), args.ids.reshape(b * t)
  loss, logp, entropy = vjp.loss_logps(vjp.Static(cfg, b, t, call.sharding), x, ids, data)
  obj = policy_objective(logp.reshape(b, t), args.mask, args.advantages, spec, **_logps(args))
  return loss, reference.make_aux(args.mask, logp.reshape(b, t), entropy.reshape(b, t), obj)


def _sequence_level(call: Call, kernel_cfg, token_logps, thr):
  """GSPO / sequence IS modes: the statistics forward, the [B, T] objective, the backward kernel
  (three passes: a token's weight is known only once its whole sequence's log-probs are)."""
  args = call.args
  b, t, v = args.logits.shape
  x, ids = args.logits.reshape(b * t, v), args.ids.reshape(b * t)
  logp, entropy = shard_rows(call.sharding, functools.partial(token_logps, kernel_cfg))(x, ids, thr)
  return reference.objective_and_loss(
    logp.reshape(b, t),
    entropy.reshape(b, t),
    args.mask,
    args.advantages,
    call.spec,
    num_items_in_batch=call.num_items_in_batch,
    **_logps(args),
  )


def bucket(shape: dict) -> str:
  """The tuning cache's key: tokens rounded up to a power of two; the vocabulary exact (it decides
  which blocks are legal)."""
  return f"{shape['dtype']}/n{ops.pow2(shape['tokens'])}/v{shape['vocab']}"


IMPLEMENTATIONS = {
  "pallas": ops.Impl(
    modules=(pallas, pallas_tpu, pallas_triton),
    blocks=(pallas_blocks.LossBlocks,),
    heuristic=lambda target, s: pallas_blocks.default_blocks(
      target, s["tokens"], s["vocab"], s["dtype"]
    ),
    candidates=pallas_blocks.candidate_blocks,
    supported_on=pallas_blocks.supported_on,
    run=functools.partial(_run_kernel, config=_pallas_config, token_logps=pallas.token_logps),
  ),
  "xla": ops.Impl(modules=(reference,), run=_run_reference),
  "mosaic_gpu": ops.Impl(
    modules=(mosaic_gpu, mosaic_gpu_cluster, mosaic_gpu_train),
    blocks=(mosaic_gpu_blocks.MosaicLossBlocks, mosaic_gpu_blocks.ClusterLossBlocks),
    platforms=("cpu", "gpu"),
    heuristic=lambda target, s: mosaic_gpu_blocks.default_blocks(s["dtype"]),
    candidates=mosaic_gpu_blocks.candidate_blocks,
    supported_on=mosaic_gpu_blocks.supported_on,
    run=functools.partial(
      _run_kernel, config=_mosaic_config, token_logps=mosaic_gpu.token_logps_cfg
    ),
  ),
}

OP = ops.Op("grpo_loss", IMPLEMENTATIONS, bucket, auto=dict(cpu="xla", gpu="pallas", tpu="pallas"))
