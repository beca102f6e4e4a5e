"""Where the loop hands the run's mesh to the Pallas kernels, so they run shard-local inside the
sharded train step and decode chunk (a Mosaic kernel is opaque to XLA's partitioner: "Mosaic kernels
cannot be automatically partitioned" when one sits in a program over several devices).

The kernels take it as ``sharding=kernels.sharding.KernelSharding(mesh, batch_axes=...)``: each device
runs the kernel on its own rows of the batch axes (and, for the fused LM-head loss, its slice of the
vocabulary on the tensor-parallel axis). The loop calls the kernels from ONE place each — the policy
loss (rl.update.policy_loss, with LossSettings' kernel_sharding; rl.agent's through rl.agent.ppo.policy_loss,
with UpdateSettings') and the paged decode attention
(`paged_attention` below, from rl.rollout.paged_cache.PagedKVCache.attend, with the cache's
kernel_sharding) — and builds the value here.
"""

from __future__ import annotations

import kernels
from kernels.sharding import KernelSharding

BATCH_AXES = ("dp", "fsdp")  # rl.sharding.data_axes(): the axes a batch's rows are split over
TP_AXIS = "tp"


def batch_sharding(mesh, batch_axes: tuple[str, ...] = BATCH_AXES) -> KernelSharding | None:
  """The loss kernels' layout in a program over `mesh`: rows over `batch_axes`, the fused loss's LM
  head over the vocabulary on the tensor-parallel axis when it has more than one device; None on one
  device (nothing to partition)."""
  if mesh is None or mesh.size == 1:
    return None
  vocab = TP_AXIS if mesh.shape.get(TP_AXIS, 1) > 1 else None
  return KernelSharding(mesh, batch_axes=tuple(batch_axes), vocab_axis=vocab)


def decode_sharding(
  mesh, heads_axis: str | None, batch_axes: tuple[str, ...] = BATCH_AXES
) -> KernelSharding | None:
  """The paged decode kernel's layout: rows over `batch_axes`, kv heads over `heads_axis` (None:
  replicated); None on one device."""
  if mesh is None or mesh.size == 1:
    return None
  return KernelSharding(mesh, batch_axes=tuple(batch_axes), head_axis=heads_axis)


def paged_attention(
  q,  # [B, Hq, D]
  k_pages,  # [Hkv, N, page_size, D]
  v_pages,  # [Hkv, N, page_size, D]
  lengths,  # [B] int32
  table,  # [B, W] int32
  impl: str,
  sharding: KernelSharding | None = None,
):  # -> [B, Hq, D]
  """kernels.paged_attention, shard-local over the rows (and heads) where `sharding` says so: the
  ONE call of the decode kernel in the loop."""
  return kernels.paged_attention(q, k_pages, v_pages, lengths, table, impl=impl, sharding=sharding)
