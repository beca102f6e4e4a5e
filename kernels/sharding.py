"""How a kernel's inputs are sharded: one small, validated value every public kernel entry takes as
``sharding=``, and the ``shard_map`` that runs its Pallas calls shard-local.

XLA cannot partition a Mosaic kernel (``"Mosaic kernels cannot be automatically partitioned"``): a
``pallas_call`` whose operands are sharded must sit inside a ``shard_map``. The kernels' rows are
independent (a token's log-sum-exp, a sequence's decode attention), so mapping the row axis over the
batch mesh axes is exact; reductions across rows (the loss's token counts, the mean over B) are
computed by the callers outside the map, on the whole (sharded) arrays, where XLA partitions them.

    sh = KernelSharding(mesh, batch_axes=("dp", "fsdp"))           # rows over dp x fsdp
    loss, aux = kernels.grpo_loss(logits, ids, mask, adv, sharding=sh)
    sh = KernelSharding(mesh, batch_axes=("fsdp",), vocab_axis="tp")  # + the LM head over V
    loss, aux = kernels.fused_linear_grpo_loss(h, w, ids, mask, adv, sharding=sh)
    sh = KernelSharding(mesh, batch_axes=("dp",), head_axis="tp")   # sequences x kv heads
    out = kernels.paged_attention(q, k_pages, v_pages, lengths, pages, sharding=sh)

Mesh axes a sharding does not name are replicated over (every device on them runs the same rows).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

__all__ = ["KernelSharding", "local_batch", "shard_rows"]


@dataclasses.dataclass(frozen=True)
class KernelSharding:
  """Which mesh axes split a kernel's inputs (frozen, hashable, checked on construction).

  mesh: a ``jax.sharding.Mesh``.
  batch_axes: the axes the leading (batch / token) axis is split over, in mesh order of nesting
    (``("dp", "fsdp")``: as ``PartitionSpec(("dp", "fsdp"))``); may be empty.
  vocab_axis: the LM head's vocabulary split (``fused_linear_grpo_loss``; tensor parallelism).
  head_axis: the kv heads' split (``paged_attention``: q heads follow their kv head); may be the
    same axis as vocab_axis (one object for a (dp, fsdp, tp) loop: each kernel reads its fields).

  A kernel ignores the fields it has no use for: ``grpo_loss`` reads batch_axes only (its rows need
  the whole vocabulary: V-sharded logits are gathered), ``paged_attention`` batch_axes and head_axis,
  ``fused_linear_grpo_loss`` batch_axes and vocab_axis.
  """

  mesh: Mesh
  batch_axes: tuple[str, ...] = ()
  vocab_axis: str | None = None
  head_axis: str | None = None

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise TypeError(f"KernelSharding.mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")  # fmt: skip
    axes = self.batch_axes
    if isinstance(axes, str):  # one axis given bare: ("dp",)
      axes = (axes,)
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes):
      raise TypeError(f"KernelSharding.batch_axes must be a tuple of mesh axis names, got {axes!r}")
    object.__setattr__(self, "batch_axes", tuple(axes))
    for field, a in [("batch_axes", a) for a in self.batch_axes] + [
      (f, getattr(self, f)) for f in ("vocab_axis", "head_axis") if getattr(self, f) is not None
    ]:
      if a not in self.mesh.axis_names:
        raise ValueError(
          f"KernelSharding.{field}: {a!r} is not an axis of the mesh {tuple(self.mesh.axis_names)}"
        )
    # vocab_axis and head_axis may share the tensor-parallel axis (no kernel uses both); an axis
    # that splits the batch cannot also split V or the heads
    dup = sorted({a for a in self.batch_axes if self.batch_axes.count(a) > 1})
    dup += sorted(set(self.batch_axes) & {self.vocab_axis, self.head_axis})
    if dup:
      raise ValueError(
        f"KernelSharding: mesh axes {dup} appear twice in batch_axes or in batch_axes and "
        "vocab_axis / head_axis (one role per axis)"
      )

  @property
  def batch_shards(self) -> int:
    """How many pieces the leading axis is split into."""
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  def axis_size(self, axis: str | None) -> int:
    return 1 if axis is None else self.mesh.shape[axis]

  def rows(self, *rest) -> P:
    """The spec of an array whose leading axis is split over the batch axes."""
    return P(self.batch_axes or None, *rest)

  def check_rows(self, name: str, size: int) -> None:
    """ValueError unless ``size`` (the batch of argument ``name``) splits evenly over the batch axes."""
    if size % self.batch_shards:
      raise ValueError(
        f"{name}: B={size} is not divisible by the {self.batch_shards} shards of "
        f"sharding.batch_axes {self.batch_axes}"
      )

  def check_axis(self, field: str, what: str, size: int) -> None:
    """ValueError unless ``size`` (e.g. V or Hkv) splits evenly over the axis in ``field``."""
    n = self.axis_size(getattr(self, field))
    if size % n:
      raise ValueError(
        f"{what}={size} is not divisible by the {n} shards of sharding.{field} "
        f"{getattr(self, field)!r}"
      )


def local_batch(sharding: KernelSharding | None, name: str, b: int) -> int:
  """One shard's batch: ``b`` over the batch axes (``b`` without a sharding); ValueError naming the
  argument ``name`` when they do not divide it."""
  if sharding is None:
    return b
  sharding.check_rows(name, b)
  return b // sharding.batch_shards


def shard_rows(sharding: KernelSharding | None, fn: Callable) -> Callable:
  """``fn`` run shard-local: every argument and result is split on its leading axis over the batch
  axes (and replicated over the others). The identity without a sharding. Arguments must have a
  leading axis that the batch shards divide (the callers check)."""
  if sharding is None:
    return fn

  def mapped(*args):
    spec = sharding.rows()
    return jax.shard_map(fn, mesh=sharding.mesh, in_specs=spec, out_specs=spec, check_vma=False)(
      *args
    )

  return mapped
