"""TPU generations and slices: the one table of their memories and peaks, and abstract devices to compile
for any of them on a host without a TPU.

With the ``libtpu`` wheel installed (``pip install "jax[tpu]==<jax>"``) and ``JAX_PLATFORMS=cpu``,
``jax.experimental.topologies.get_topology_desc`` returns abstract TPU devices of a whole slice, and
``jax.jit(f).trace(*specs).lower().compile()`` on ``ShapeDtypeStruct``s placed on them runs libtpu's
real compiler: Mosaic errors, VMEM and HBM ``RESOURCE_EXHAUSTED``, ``memory_analysis()``. That is
*compiled* evidence; any time derived from it is *modelled*, never measured.

Where each figure comes from (``Generation``'s fields):
  * ``vmem_bytes``: what libtpu 0.0.42.1's compiler reports as a TensorCore's VMEM when a kernel asks
    for more (``RESOURCE_EXHAUSTED ... would exceed memory (size=N)``), read on this host (compiled).
  * ``hbm_bytes``: the HBM a program may use on one device, as the same compiler reports it when a
    program needs more (``exceeds available HBM (31.25G)`` on v6e: GiB, the runtime's reserve already
    taken off) (compiled).
  * ``hbm_bw``, ``bf16_flops``: Google's Cloud TPU datasheets, per JAX device (a v7x chip is two
    devices; v4 and v5p chips are one "megacore" device).
  * ``clock_hz``: derived, ``bf16_flops / (MXUs x MXU flops per cycle)`` (a 128x128 MXU does 32768
    multiply-adds a cycle, 256x256 131072), which gives the published clocks where they are published
    (v4 1050 MHz); the static-schedule model (bundles / clock) uses it.

Slices are named as users rent them: ``v6e-8``, ``v5litepod-16``, ``v4-8``, ``v5p-16``, ``tpu7x-8``.
v5e / v6e names count chips; v4, v5p and v7x names count TensorCores (two per chip).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Generation:
  """One TPU generation, per JAX device (see the module docstring for each figure's source)."""

  name: str  # "v6e"
  device_kind: str  # jax's Device.device_kind: "TPU v6 lite"
  topology_name: str  # libtpu's topology prefix: "v6e"
  vmem_bytes: int  # one TensorCore's VMEM (compiled)
  hbm_bytes: int  # HBM a program may use per device (compiled)
  hbm_bw: float  # bytes/s per device (datasheet)
  bf16_flops: float  # FLOP/s per device (datasheet)
  mxus: int  # MXUs per device
  mxu_dim: int  # 128 or 256
  cores_per_chip: int  # TensorCores a chip has (named by slice names that count cores)
  devices_per_chip: int  # JAX devices a chip shows (megacore: 1)
  chips_per_host: int
  dims: int  # 2 (torus of v5e / v6e) or 3
  chip_config: str | None = None  # libtpu's chip_config_name (v4: "megacore", as on a v4 VM)
  name_counts_cores: bool = False  # "v4-8" is 8 TensorCores = 4 chips

  @property
  def clock_hz(self) -> float:
    """Derived from the datasheet peak: bf16_flops / (MXUs * 2 * mxu_dim^2)."""
    return self.bf16_flops / (self.mxus * 2 * self.mxu_dim**2)


GENERATIONS: dict[str, Generation] = {
  g.name: g
  for g in (
    Generation("v4", "TPU v4", "v4", 16 * 2**20, int(30.75 * GiB), 1.2e12, 275e12, 8, 128, 2, 1, 4, 3, chip_config="megacore", name_counts_cores=True),
    Generation("v5e", "TPU v5 lite", "v5e", 128 * 2**20, int(15.75 * GiB), 819e9, 197e12, 4, 128, 1, 1, 8, 2),
    Generation("v5p", "TPU v5", "v5p", 64 * 2**20, int(95.74 * GiB), 2.765e12, 459e12, 8, 128, 2, 1, 4, 3, name_counts_cores=True),
    Generation("v6e", "TPU v6 lite", "v6e", 128 * 2**20, int(31.25 * GiB), 1.64e12, 918e12, 4, 256, 1, 1, 8, 2),
    Generation("v7x", "TPU7x", "tpu7x", 64 * 2**20, int(94.75 * GiB), 3.69e12, 1153.5e12, 4, 256, 2, 2, 4, 3, name_counts_cores=True),
  )
}  # fmt: skip
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "tpu7x": "v7x", "v6": "v6e"}
# A heuristic with no generation to go on (a plain "tpu" lowering) must fit every generation's VMEM.
SMALLEST_VMEM = min(g.vmem_bytes for g in GENERATIONS.values())


def generation(name: str) -> Generation:
  """The generation named ``name`` ("v6e", "v5litepod", "tpu7x", ...); ValueError naming the known ones."""
  key = ALIASES.get(name, name)
  if key not in GENERATIONS:
    raise ValueError(f"unknown TPU generation {name!r}; known: {sorted(GENERATIONS)}")
  return GENERATIONS[key]


def generation_of_kind(device_kind: str) -> Generation | None:
  """The generation of a real device's ``device_kind`` (None for a kind this table lacks)."""
  for g in GENERATIONS.values():
    if device_kind == g.device_kind:
      return g
  return None


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice as rented: ``Slice.parse("v6e-8")``. ``chips`` over ``hosts`` hosts."""

  generation: Generation
  chips: int

  @classmethod
  def parse(cls, name: str) -> Slice:
    """ "v6e-8" / "v4-16" / "v5litepod-4" / "tpu7x-8"; "v6e" alone is one chip."""
    m = re.fullmatch(r"([a-z0-9]+?)(?:-(\d+))?", name.strip().lower())
    if m is None:
      raise ValueError(f"TPU slice {name!r} is not of the form <generation>-<count>, e.g. 'v6e-8'")
    gen = generation(m.group(1))
    count = int(m.group(2) or (gen.cores_per_chip if gen.name_counts_cores else 1))
    per_chip = gen.cores_per_chip if gen.name_counts_cores else 1
    if count < per_chip or count % per_chip:
      raise ValueError(
        f"TPU slice {name!r}: {gen.name} slice names count "
        f"{'TensorCores (' + str(per_chip) + ' per chip)' if gen.name_counts_cores else 'chips'}; "
        f"{count} is not a whole number of chips"
      )
    chips = count // per_chip
    if chips & (chips - 1):
      raise ValueError(f"TPU slice {name!r}: {chips} chips is not a power of two")
    return cls(gen, chips)

  @property
  def name(self) -> str:
    per_chip = self.generation.cores_per_chip if self.generation.name_counts_cores else 1
    return f"{self.generation.name}-{self.chips * per_chip}"

  @property
  def devices(self) -> int:
    return self.chips * self.generation.devices_per_chip

  @property
  def hosts(self) -> int:
    return max(1, self.chips // self.generation.chips_per_host)

  def bounds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(chip grid, chips per host) as libtpu's topology wants them: a near-square torus."""
    per_host = _grid(min(self.chips, self.generation.chips_per_host), self.generation.dims)
    return _grid(self.chips, self.generation.dims), (per_host + (1, 1))[:3]

  def topology_string(self) -> str:
    grid, _ = self.bounds()
    return f"{self.generation.topology_name}:" + "x".join(map(str, grid))


def _grid(chips: int, dims: int) -> tuple[int, ...]:
  """chips (a power of two) as the torus a slice of that size has: 3-D 1x1x1, 2x1x1, 2x2x1, 2x2x2, then
  the smallest side doubled (ties: the last), 2x2x4, 2x4x4, 4x4x4, ...; 2-D 1x1, 1x2, 2x2, 2x4, 4x4."""
  if dims == 3 and chips <= 8:
    return {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2)}[chips]
  sides = [2, 2, 2] if dims == 3 else [1, 1]
  for _ in range(int(math.log2(chips)) - (3 if dims == 3 else 0)):
    smallest = min(sides)
    i = max(k for k in range(dims) if sides[k] == smallest)
    sides[i] *= 2
  return tuple(sides)


@functools.cache
def topology(slice_name: str):
  """The slice's ``jax.experimental.topologies.TopologyDescription`` (needs libtpu; cached)."""
  from jax.experimental import topologies

  sl = Slice.parse(slice_name)
  _, per_host = sl.bounds()
  kw = {"chips_per_host_bounds": per_host}
  if sl.generation.chip_config:
    kw["chip_config_name"] = sl.generation.chip_config
  try:
    return topologies.get_topology_desc(sl.topology_string(), "tpu", **kw)
  except Exception as e:  # libtpu missing (jax raises its own error) or too old for the generation
    raise RuntimeError(
      f"cannot build the abstract TPU slice {sl.name} ({sl.topology_string()}): {e}. Deviceless TPU "
      'compiles need libtpu: pip install "jax[tpu]==<the installed jax>" (nox -s tpu_compile has it)'
    ) from e


def devices(slice_name: str) -> list:
  """The slice's abstract TPU devices, in the order a real slice lists them."""
  return list(topology(slice_name).devices)


def libtpu_available() -> bool:
  """Whether a deviceless TPU compile can run here (the libtpu wheel is importable)."""
  import importlib.util

  return importlib.util.find_spec("libtpu") is not None


def libtpu_version() -> str | None:
  from importlib import metadata

  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return None
