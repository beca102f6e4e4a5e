"""The TPU generation table and slice names (kernels.tpu_targets), and the Target's generation.

The slice arithmetic runs everywhere; building a slice's abstract devices needs libtpu and is checked
where it is installed (the tpu_compile session), skipped elsewhere."""

import pytest

from kernels import backend, tpu_targets
from kernels.tpu_targets import Slice

# (name as rented, chips, devices, hosts, libtpu topology): v4 / v5p / v7x names count TensorCores,
# v5e / v6e names count chips; a v7x chip shows two devices, v4 / v5p chips one (megacore).
SLICES = [
  ("v6e", 1, 1, 1, "v6e:1x1"),
  ("v6e-4", 4, 4, 1, "v6e:2x2"),
  ("v6e-8", 8, 8, 1, "v6e:2x4"),
  ("v6e-16", 16, 16, 2, "v6e:4x4"),
  ("v5litepod-8", 8, 8, 1, "v5e:2x4"),
  ("v4-8", 4, 4, 1, "v4:2x2x1"),
  ("v4-16", 8, 8, 2, "v4:2x2x2"),
  ("v4-32", 16, 16, 4, "v4:2x2x4"),
  ("v5p-8", 4, 4, 1, "v5p:2x2x1"),
  ("tpu7x-8", 4, 8, 1, "tpu7x:2x2x1"),
]


@pytest.mark.parametrize("name,chips,devices,hosts,topology", SLICES)
def test_slice_names_as_rented(name, chips, devices, hosts, topology):
  """Catches: counting a v4-8's TensorCores as chips (8 chips instead of 4, twice the HBM)."""
  sl = Slice.parse(name)
  assert (sl.chips, sl.devices, sl.hosts, sl.topology_string()) == (chips, devices, hosts, topology)


@pytest.mark.parametrize(
  "name,match",
  [
    ("v6e-3", "power of two"),
    ("v4-6", "power of two"),
    ("v4-1", "whole number of chips"),
    ("v9-8", "unknown TPU generation"),
    ("v6e-x", "<generation>-<count>"),
  ],
)
def test_bad_slice_names_say_why(name, match):
  with pytest.raises(ValueError, match=match):
    Slice.parse(name)


def test_clock_derived_from_peak_matches_published_v4_clock():
  """The static-schedule model divides bundles by this clock: v4's 1050 MHz is published."""
  assert tpu_targets.generation("v4").clock_hz == pytest.approx(1.05e9, rel=0.01)
  assert tpu_targets.generation("v5litepod").name == "v5e"


def test_target_generation_sets_the_vmem_budget():
  """An unnamed TPU target plans for the smallest VMEM (v4's 16 MiB), so it compiles everywhere."""
  assert backend.make_target("tpu", interpret=False).vmem_bytes == 16 * 2**20
  assert backend.make_target("tpu", interpret=False, generation="v6e").vmem_bytes == 128 * 2**20
  with backend.use_target("tpu", interpret=False, generation="v5p"):
    assert backend.resolve().generation == "v5p"
    assert backend.resolve("tpu").generation == "v5p"  # the explicit platform keeps the context's
  with pytest.raises(ValueError, match="tpu platform"):
    backend.Target("gpu", generation="v6e")


@pytest.mark.skipif(not tpu_targets.libtpu_available(), reason="needs libtpu (nox -s tpu_compile)")
@pytest.mark.parametrize("name,chips,devices,hosts,topology", SLICES)
def test_abstract_slice_devices(name, chips, devices, hosts, topology):
  """Catches: a slice built with the wrong host bounds (v6e-8 is one host of 8 chips)."""
  devs = backend.tpu_devices(name)
  assert len(devs) == devices
  assert len({d.process_index for d in devs}) == hosts
  assert devs[0].device_kind == Slice.parse(name).generation.device_kind
