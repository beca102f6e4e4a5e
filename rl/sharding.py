"""The device mesh: axes (dp, fsdp, tp). The one place that decides how devices are laid out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("dp", "fsdp", "tp")


def make_mesh(
  dp: int = 1, fsdp: int = -1, tp: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
  """A (dp, fsdp, tp) mesh over `devices` (default: all). One axis may be -1: it takes what is left."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [dp, fsdp, tp]
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got dp={dp} fsdp={fsdp} tp={tp}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh axis sizes must be positive or -1, got dp={dp} fsdp={fsdp} tp={tp}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(
        f"{len(devices)} devices do not divide into dp*fsdp*tp with fixed axes = {known}"
      )
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(
      f"mesh dp={sizes[0]} fsdp={sizes[1]} tp={sizes[2]} needs {math.prod(sizes)} devices, "
      f"{len(devices)} available"
    )
  # Auto axes: shardings propagate through the program as in classic jit (jax's default is Explicit).
  return jax.make_mesh(tuple(sizes), AXES, devices=devices, axis_types=(AxisType.Auto,) * len(AXES))


def initialize_distributed(
  initialize: bool,
  coordinator_address: str | None,
  num_processes: int | None,
  process_id: int | None,
  cpu_collectives: str = "gloo",
  host_devices: int | None = None,
) -> None:
  """Process-level setup, before jax touches a device: simulated CPU devices and multi-process init."""
  if host_devices:
    jax.config.update("jax_num_cpu_devices", host_devices)
  if initialize:
    # CPU processes need a cross-process collectives backend; accelerators bring their own.
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )


def mesh_for(dp: int, fsdp: int, tp: int) -> Mesh:
  """The run's mesh: all devices when an axis is -1, else the first dp*fsdp*tp (every process's, when
  several processes share the run: a multi-process mesh must span all of them)."""
  sizes = (dp, fsdp, tp)
  if -1 in sizes:
    return make_mesh(*sizes)
  n = math.prod(sizes)
  if jax.process_count() > 1 and n != jax.device_count():
    raise ValueError(
      f"a multi-process mesh must use all {jax.device_count()} devices, got dp*fsdp*tp = {n}"
    )
  return make_mesh(*sizes, devices=jax.devices()[:n])


def data_axes() -> tuple[str, str]:
  """The mesh axes a batch's sequence dimension is split over."""
  return ("dp", "fsdp")


def global_batch(
  mesh: Mesh,
  local,  # [K, M_local, ...] this process's rows of every micro-batch
) -> jax.Array:  # [K, M_local * processes, ...] sharded over (dp, fsdp) on axis 1
  """This process's slice of every micro-batch -> one global array (rows of process p come p-th)."""
  sharding = NamedSharding(mesh, P(None, data_axes()))
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  shape = (local.shape[0], local.shape[1] * jax.process_count(), *local.shape[2:])
  return jax.make_array_from_process_local_data(sharding, local, shape)


def allgather(x):
  """Every process's `x` (a numpy array / pytree), concatenated along axis 0 in process order."""
  if jax.process_count() == 1:
    return x
  return multihost_utils.process_allgather(x, tiled=True)


def local_rows(
  mesh: Mesh,
  x: jax.Array,  # [K, M, ...] a global_batch-laid-out array
):  # -> np.ndarray [K, M_local, ...]
  """The inverse of global_batch: this process's rows of every micro-batch, on the host."""
  if jax.process_count() == 1:
    return np.asarray(x)
  local = multihost_utils.global_array_to_host_local_array(x, mesh, P(None, data_axes()))
  return np.asarray(local)


def replicated(mesh: Mesh, tree):
  """Leaves not laid out on `mesh` yet (freshly initialised, one device) -> replicated over it, so a
  jit over the mesh (several processes included) takes them; leaves already on it are kept."""

  def put(x):
    if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
      return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P()), lambda i: host[i])

  return jax.tree.map(put, tree)
