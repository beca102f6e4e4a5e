"""Where the loop hands the run's mesh to the Pallas kernels, so they run shard-local inside the
sharded train step and decode chunk (a Mosaic kernel is opaque to XLA's partitioner: "Mosaic kernels
cannot be automatically partitioned" when one sits in a program over several devices).

The kernels take it as `sharding=KernelSharding(mesh, batch_axes=...)` (kernels/sharding.py, branch
`tpukernels`): each device runs the kernel on its own rows of the batch axes. The loop calls the
kernels from ONE place each — the policy loss (rl.update.policy_loss, with LossSettings'
kernel_sharding) and the paged decode attention (`paged_attention` below, from
rl.rollout.paged_cache.PagedKVCache.attend, with the cache's kernel_sharding) — and builds the value
here (`batch_sharding`).

Until kernels.sharding exists: the loss kernels get no sharding (a multi-device run uses
train.policy_loss_impl=xla), and the decode kernel is made shard-local here with `jax.shard_map`
over the rows (`RowSharding`): decode attention has no reduction across rows, so each device's rows
against the whole (replicated) pool are exactly its share of the result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import kernels

try:  # the shard-local kernel entries (branch tpukernels); absent before it is merged
  from kernels.sharding import KernelSharding
except ImportError:
  KernelSharding = None

BATCH_AXES = ("dp", "fsdp")  # rl.sharding.data_axes(): the axes a batch's rows are split over


@dataclasses.dataclass(frozen=True)
class RowSharding:
  """The loop's own layout of the decode kernel while kernels.sharding is absent: rows over
  `batch_axes`, the KV heads over `heads_axis` (or replicated: None)."""

  mesh: Mesh
  batch_axes: tuple[str, ...]
  heads_axis: str | None = None


def available() -> bool:
  """Whether the kernels accept a sharding themselves (kernels.sharding is merged)."""
  return KernelSharding is not None


def batch_sharding(mesh, batch_axes: tuple[str, ...] = BATCH_AXES) -> Any:
  """The loss kernels' layout in a program over `mesh` whose batch rows are split over
  `batch_axes`; None on one device (nothing to partition) or without kernels.sharding."""
  if mesh is None or mesh.size == 1 or KernelSharding is None:
    return None
  return KernelSharding(mesh, batch_axes=tuple(batch_axes))


def decode_sharding(mesh, heads_axis: str | None, batch_axes: tuple[str, ...] = BATCH_AXES):
  """The paged decode kernel's layout: kernels.sharding's when merged, else the loop's RowSharding;
  None on one device."""
  if mesh is None or mesh.size == 1:
    return None
  if KernelSharding is not None:
    return KernelSharding(mesh, batch_axes=tuple(batch_axes))
  return RowSharding(mesh, tuple(batch_axes), heads_axis)


def kernel_kwargs(sharding) -> dict:
  """The keyword a kernel entry takes the layout as (nothing when there is none, or when it is the
  loop's own RowSharding, which the kernels do not know)."""
  return {} if sharding is None or isinstance(sharding, RowSharding) else {"sharding": sharding}


def paged_attention(
  q,  # [B, Hq, D]
  k_pages,  # [Hkv, N, page_size, D]
  v_pages,  # [Hkv, N, page_size, D]
  lengths,  # [B] int32
  table,  # [B, W] int32
  impl: str,
  sharding=None,
):  # -> [B, Hq, D]
  """kernels.paged_attention, shard-local over the rows where `sharding` says so: the ONE call of
  the decode kernel in the loop."""
  call = lambda *a: kernels.paged_attention(*a, impl=impl, **kernel_kwargs(sharding))
  if not isinstance(sharding, RowSharding):
    return call(q, k_pages, v_pages, lengths, table)
  rows, heads = P(sharding.batch_axes), sharding.heads_axis
  pool = P(heads)
  qspec = P(sharding.batch_axes, heads)
  return jax.shard_map(
    call,
    mesh=sharding.mesh,
    in_specs=(qspec, pool, pool, rows, P(sharding.batch_axes, None)),
    out_specs=qspec,
    check_vma=False,  # the kernel's outputs vary over the rows exactly as its inputs do
  )(q, k_pages, v_pages, lengths, table)
