"""A Mosaic TPU kernel's VMEM budget per generation: the scoped default it gets without asking, and
the ``vmem_limit_bytes`` to ask for when a step needs more.

The physical VMEM per TensorCore is :attr:`kernels.backend.Target.vmem_bytes` (the generation table
in :mod:`kernels.tpu_targets`). The scoped defaults below are what libtpu 0.0.42.1 reports when a
kernel asks for more than it may ("Scoped allocation with size 52.00M and limit 16.00M"; compiled on
this host): a kernel whose step stays under them compiles without a limit; above, it must pass
``vmem_limit_bytes`` (up to the physical VMEM, which the compiler accepts as the cap).
"""

from __future__ import annotations

from kernels.backend import Target

MiB = 2**20
SCOPED_VMEM = {"v4": 16 * MiB, "v5e": 16 * MiB, "v5p": 16 * MiB, "v6e": 32 * MiB, "v7x": 32 * MiB}


def scoped_vmem(target: Target) -> int:
  """The scoped VMEM default of ``target``'s generation (the smallest when it is unknown)."""
  return SCOPED_VMEM.get(target.generation, min(SCOPED_VMEM.values()))


def vmem_limit(target: Target, need: int) -> int | None:
  """``vmem_limit_bytes`` for a kernel step needing ``need`` bytes: None (the scoped default) when
  that holds it, else the generation's whole VMEM (a cap, not an allocation: the compiler allocates
  what the kernel uses). Callers keep ``need`` <= ``target.vmem_bytes`` (their ``legal_on``)."""
  if target.platform != "tpu" or target.interpret or need <= scoped_vmem(target):
    return None
  return target.vmem_bytes
