"""``paged_attention``'s implementations: the op's one table (:class:`kernels.ops.Op`), and how the
public function calls each (``Impl.run(call)``).

  xla         gather the pages into a dense context, then attention: the reference (:mod:`.reference`)
  pallas      the Pallas kernels (:mod:`.pallas`): Mosaic TPU / its CPU interpreter
              (:mod:`.pallas_tpu`), Triton on GPU (:mod:`.pallas_triton`); blocks ``PagedBlocks``
  mosaic_gpu  the Hopper kernel (:mod:`.mosaic_gpu`); blocks ``MosaicPagedBlocks``

``impl="auto"``: the tuned cache's choice, else xla on CPU (the interpreter is only a correctness
tool) and pallas on GPU and TPU. The kernels run shard-local under a ``shard_map`` when the call has a
sharding (XLA cannot partition a Mosaic call).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels import ops
from kernels.backend import Target
from kernels.paged_attention import (
  mosaic_gpu,
  mosaic_gpu_blocks,
  pallas,
  pallas_blocks,
  pallas_tpu,
  pallas_triton,
  plan,
  reference,
)
from kernels.sharding import KernelSharding


@dataclasses.dataclass(frozen=True)
class Call:
  """One validated call of ``paged_attention`` (lengths clamped, page ids in the pool)."""

  arrays: (
    tuple  # (q [B, Hq, D], k_pages, v_pages [Hkv, P, page_size, D], lengths [B], page_indices)
  )
  scale: float
  target: Target
  blocks: Any  # the impl's blocks (None: its heuristic)
  sharding: KernelSharding | None
  shape: dict  # the tuner's dict: dtype, batch, q_heads, kv_heads (one shard's), head_dim, ...


def _shard(sharding: KernelSharding | None, kernel):
  """``kernel(q, k_pages, v_pages, lengths, page_indices)`` run shard-local: sequences over the batch
  axes, kv heads (and their q heads) over the head axis."""
  if sharding is None:
    return kernel
  rows, heads = sharding.batch_axes or None, sharding.head_axis
  kv = P(heads)
  return jax.shard_map(
    kernel,
    mesh=sharding.mesh,
    in_specs=(P(rows, heads), kv, kv, P(rows), P(rows)),
    out_specs=P(rows, heads),
    check_vma=False,
  )


def _run_reference(call: Call):
  return reference.paged_attention_reference(*call.arrays, scale=call.scale)


def _run_mosaic(call: Call):
  kernel = functools.partial(mosaic_gpu.paged_attention, scale=call.scale, target=call.target, blocks=call.blocks)  # fmt: skip
  return _shard(call.sharding, kernel)(*call.arrays)


def _run_pallas(call: Call):
  """The Pallas kernels, their blocks (the heuristic's by default) checked before Mosaic sees them."""
  s, target = call.shape, call.target
  blocks = call.blocks or _pallas_heuristic(target, s)
  reason = _pallas_supported_on(target, s, blocks)  # tiles and, on TPU, a step's VMEM
  if reason:
    raise ValueError(f"paged_attention blocks {blocks}: {reason}")
  d = s["head_dim"]
  if target.platform == "gpu" and d & (d - 1):
    raise ValueError(f"the GPU kernel needs a power-of-two head_dim, got {d}")
  cfg = pallas_blocks.PagedConfig(target, blocks, call.scale)
  return _shard(call.sharding, functools.partial(pallas.paged_attention, cfg))(*call.arrays)


def _pages(s: dict) -> int:
  return -(-s["ctx"] // s["page_size"])


def _pallas_heuristic(target: Target, s: dict) -> pallas_blocks.PagedBlocks:
  return pallas_blocks.default_blocks(target, s["batch"], s["kv_heads"], _pages(s), s["page_size"])


def _splits_for(s: dict, tokens: int) -> list[int]:
  """Split-K counts worth trying for a ``tokens``-token tile: 1, the wave heuristic's
  (:func:`.plan.wave_splits`) and its double; a tile must leave at least one block per split."""
  pages = _pages(s)
  blocks_total = -(-pages // max(1, tokens // s["page_size"]))
  wave = plan.wave_splits(s["batch"] * s["kv_heads"], blocks_total)
  return sorted({n for n in (1, wave, 2 * wave) if n <= blocks_total})


def _pallas_supported_on(target: Target, s: dict, blocks) -> str | None:
  return pallas_blocks.legal_on(target, blocks or _pallas_heuristic(target, s), s)


def _pallas_candidates(s: dict, platform: str) -> list:
  """GPU: Triton over tile tokens x pipeline stages x splits x warps; elsewhere the heuristic."""
  if platform != "gpu":
    return [None]
  ps, out = s["page_size"], []
  for tokens, stages, warps in itertools.product((32, 64, 128), (2, 3, 4, 6), (4, 8)):
    if max(1, tokens // ps) * ps < 16 or (tokens >= 128 and stages > 4):  # Triton dot; smem
      continue
    for splits in _splits_for(s, tokens):
      out.append(pallas_blocks.PagedBlocks(max(1, tokens // ps), splits, num_stages=stages, num_warps=warps))  # fmt: skip
  return out


def _mosaic_heuristic(target: Target, s: dict) -> mosaic_gpu_blocks.MosaicPagedBlocks:
  del target
  dims = (s["batch"], s["kv_heads"], _pages(s), s["page_size"], s["head_dim"], s["dtype"])
  return mosaic_gpu_blocks.default_blocks(*dims)


def _mosaic_shape_reason(s: dict) -> str | None:
  """Why the Mosaic GPU kernel takes no blocks at all at ``s`` (dtype, head_dim, page size), or None."""
  if jnp.dtype(s["dtype"]).name not in mosaic_gpu_blocks.DTYPES or s["head_dim"] % 64:
    return f"the Mosaic GPU kernel needs {mosaic_gpu_blocks.DTYPES} pages and head_dim % 64 == 0"
  if s["page_size"] % 8:
    return f"the Mosaic GPU kernel needs page_size a multiple of 8, got {s['page_size']}"
  return None


def _mosaic_supported_on(target: Target | None, s: dict, blocks) -> str | None:
  """Why the Mosaic GPU kernel cannot run ``blocks`` (None: the heuristic's) here, or None."""
  if target is not None and target.platform == "tpu":
    return "impl='mosaic_gpu' is a GPU kernel; on TPU use impl='pallas' (Mosaic TPU)"
  if _mosaic_shape_reason(s) is not None:
    return _mosaic_shape_reason(s)
  try:
    blocks = blocks or _mosaic_heuristic(target, s)
    blocks.check(s["page_size"], s["head_dim"], s["dtype"], _pages(s))
  except ValueError as e:  # tile not a multiple of 64 tokens, or over the shared-memory budget
    return str(e)
  return None


def _mosaic_candidates(s: dict, platform: str) -> list:
  """Tile tokens x ring stages x splits (on the CPU interpreter one configuration: the plumbing),
  those the kernel supports at ``s``."""
  if _mosaic_shape_reason(s) is not None:
    return []
  grid = [(t, st) for t in (64, 128) for st in (2, 3, 4, 5)] if platform == "gpu" else [(64, 2)]
  out = []
  for tokens, stages in grid:
    for splits in _splits_for(s, tokens) if platform == "gpu" else [1]:
      blocks = mosaic_gpu_blocks.MosaicPagedBlocks(max(1, tokens // s["page_size"]), splits, stages)
      if _mosaic_supported_on(None, s, blocks) is None:
        out.append(blocks)
  return out


def bucket(s: dict) -> str:
  """The tuning cache's key: batch and context rounded up to powers of two; heads, head_dim and
  page size exact (they change which blocks are legal)."""
  return (
    f"{s['dtype']}/b{ops.pow2(s['batch'])}/hq{s['q_heads']}/hkv{s['kv_heads']}"
    f"/d{s['head_dim']}/ps{s['page_size']}/ctx{ops.pow2(s['ctx'])}"
  )


IMPLEMENTATIONS = {
  "pallas": ops.Impl(
    modules=(pallas, pallas_tpu, pallas_triton),
    blocks=(pallas_blocks.PagedBlocks,),
    heuristic=_pallas_heuristic,
    candidates=_pallas_candidates,
    supported_on=_pallas_supported_on,
    run=_run_pallas,
  ),
  "xla": ops.Impl(modules=(reference,), run=_run_reference),
  "mosaic_gpu": ops.Impl(
    modules=(mosaic_gpu,),
    blocks=(mosaic_gpu_blocks.MosaicPagedBlocks,),
    platforms=("cpu", "gpu"),
    heuristic=_mosaic_heuristic,
    candidates=_mosaic_candidates,
    supported_on=_mosaic_supported_on,
    run=_run_mosaic,
  ),
}

OP = ops.Op("paged_attention", IMPLEMENTATIONS, bucket, auto=dict(cpu="xla", gpu="pallas", tpu="pallas"))  # fmt: skip
