"""The device mesh: axes (dp, fsdp, tp). The one place that decides how devices are laid out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

AXES = ("dp", "fsdp", "tp")


def make_mesh(dp: int = 1, fsdp: int = -1, tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
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
      raise ValueError(f"{len(devices)} devices do not divide into dp*fsdp*tp with fixed axes = {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh dp={sizes[0]} fsdp={sizes[1]} tp={sizes[2]} needs {math.prod(sizes)} devices, "
                     f"{len(devices)} available")
  # Auto axes: shardings propagate through the program as in classic jit (jax's default is Explicit).
  return jax.make_mesh(tuple(sizes), AXES, devices=devices, axis_types=(AxisType.Auto,) * len(AXES))
