"""Each config section's RANGES table is what its check enforces and what the manual's configuration
reference prints (docs/ext/configref.py): one source for both."""

import dataclasses
import math
import typing

import pytest

from rl import configlib
from rl.config import GRPOConfig


def _sections(cls=GRPOConfig, prefix=""):
  """(dotted prefix, section class) for every section of the tree, nested ones included."""
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    if dataclasses.is_dataclass(tp):
      yield prefix + f.name, tp
      yield from _sections(tp, prefix + f.name + ".")


RANGED = [
  (path, cls, name, allowed)
  for path, cls in _sections()
  for name, allowed in getattr(cls, "RANGES", {}).items()
]


def _outside(allowed: configlib.Range, section, integer: bool):
  """A value just outside `allowed` (bounds as the section's defaults resolve them)."""
  b = allowed.bounds(section)
  step = 1 if integer else 0.5
  if b["ge"] is not None:
    return b["ge"] - step
  if b["gt"] is not None:
    return b["gt"] if integer else float(b["gt"])
  if b["le"] is not None:
    return b["le"] + step
  return b["lt"]


def test_every_range_names_a_field_of_its_section():
  """Catches: a RANGES entry left behind by a renamed field, which the reference would print and
  nothing would check."""
  for path, cls, name, _ in RANGED:
    assert name in {f.name for f in dataclasses.fields(cls)}, f"{path}.{name}"


@pytest.mark.parametrize(
  ("path", "cls", "name", "allowed"), RANGED, ids=[f"{p}.{n}" for p, _, n, _ in RANGED]
)
def test_a_value_outside_the_printed_range_is_rejected_with_that_range(path, cls, name, allowed):
  """Catches: a reference that prints one range while the check enforces another (the range typed
  twice), or a field whose range is listed but never checked."""
  hints = typing.get_type_hints(cls)
  integer = hints[name] is int or typing.get_args(hints[name])[:1] == (int,)
  bad = _outside(allowed, cls(), integer)
  if isinstance(bad, float) and not math.isfinite(bad):
    pytest.skip("unbounded")
  data: dict = {}
  node = data
  for part in path.split("."):
    node = node.setdefault(part, {})
  node[name] = bad
  if path == "dist" and name == "process_id":
    node["num_processes"] = 2  # the bound the reference names
    node[name] = 2
  with pytest.raises(configlib.ConfigError) as err:
    configlib.build(GRPOConfig, data)
  # the bounds as printed, resolved for this section (a Bound prints its formula in the reference)
  section = cls(**{k: v for k, v in node.items() if k != name})
  printed = configlib.describe_bounds(**allowed.bounds(section))
  assert printed.removeprefix("in ") in str(err.value), (str(err.value), printed)
