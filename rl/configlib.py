"""Typed configuration: frozen dataclass trees built from YAML and `a.b.c=value` command-line overrides.

Every value is checked against its field's annotation before anything runs, so a typo or a wrong type
is a clear error naming the key, not a surprise deep in a compiled step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import yaml

__all__ = [
  "Bound",
  "ConfigError",
  "Range",
  "apply_overrides",
  "build",
  "check_range",
  "check_ranges",
  "describe_bounds",
  "dump",
  "from_dict",
  "given_keys",
  "load",
  "read",
  "read_json_object",
  "to_dict",
]

T = TypeVar("T")


class ConfigError(ValueError):
  """A bad config value, key or file. `python -m rl.train` prints the message alone and exits with
  status 2 (no traceback): the message names the key and what it allows."""


def check_range(
  key: str,
  value: float | None,
  *,
  gt: float | None = None,
  ge: float | None = None,
  lt: float | None = None,
  le: float | None = None,
  optional: bool = False,
) -> None:
  """Raises ValueError naming `key` and the allowed range unless `value` is a finite number within the
  given bounds (or None, when `optional`). The one range check every config section uses."""
  if value is None and optional:
    return
  ok = (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and math.isfinite(value)
    and (gt is None or value > gt)
    and (ge is None or value >= ge)
    and (lt is None or value < lt)
    and (le is None or value <= le)
  )
  if ok:
    return
  allowed = describe_bounds(gt=gt, ge=ge, lt=lt, le=le)
  if not allowed.startswith("in ") and isinstance(value, float):
    allowed = "finite and " + allowed
  raise ValueError(f"{key} must be {allowed}{' (or null)' if optional else ''}, got {value!r}")


def describe_bounds(*, gt=None, ge=None, lt=None, le=None) -> str:
  """The allowed range in words, as `check_range`'s messages and the configuration reference give
  it: "in [0, 1)", "> 0", ">= 1", "<= 2"."""
  low = "" if gt is None and ge is None else f"{gt if gt is not None else ge}"
  high = "" if lt is None and le is None else f"{lt if lt is not None else le}"
  if low and high:
    return f"in {'(' if gt is not None else '['}{low}, {high}{')' if lt is not None else ']'}"
  if low:
    return f"{'>' if gt is not None else '>='} {low}"
  return f"{'<' if lt is not None else '<='} {high}"


@dataclasses.dataclass(frozen=True)
class Bound:
  """A bound that depends on the section's other fields: `text` for the reference, `of(section)`
  for the check (e.g. ``Bound("grid_size**2 - 3", lambda s: s.grid_size**2 - 3)``)."""

  text: str
  of: typing.Callable[[Any], float]

  def __str__(self) -> str:
    return self.text


@dataclasses.dataclass(frozen=True)
class Range:
  """The allowed values of one numeric config field: `check_range`'s bounds, optionally null. Each
  section lists its fields' ranges in one table, `RANGES`, which its `__post_init__` checks
  (`check_ranges`) and the configuration reference prints: one source for both."""

  gt: float | Bound | None = None
  ge: float | Bound | None = None
  lt: float | Bound | None = None
  le: float | Bound | None = None
  optional: bool = False

  def bounds(self, section=None) -> dict[str, Any]:
    value = lambda b: b.of(section) if isinstance(b, Bound) and section is not None else b
    return {k: value(getattr(self, k)) for k in ("gt", "ge", "lt", "le")}

  def describe(self) -> str:
    return describe_bounds(**self.bounds()) + (" or null" if self.optional else "")

  def check(self, key: str, value, section) -> None:
    check_range(key, value, optional=self.optional, **self.bounds(section))


def check_ranges(section, prefix: str) -> None:
  """Checks every field of `section` listed in its `RANGES` table, naming `prefix.field`."""
  for name, allowed in type(section).RANGES.items():
    allowed.check(f"{prefix}.{name}", getattr(section, name), section)


def from_dict(cls: type[T], data: dict[str, Any] | None, path: str = "") -> T:
  """Build dataclass `cls` from a (nested) dict; unknown keys and mistyped values raise ValueError."""
  data = {} if data is None else data
  if not isinstance(data, dict):
    raise ConfigError(
      f"config section {path or '<root>'} must be a mapping, got {type(data).__name__}"
    )
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ConfigError(
      f"unknown config key(s) {[path + k for k in unknown]}; "
      f"{path.rstrip('.') or 'the root'} has {sorted(names)}"
    )
  kwargs = {k: _convert(hints[k], v, path + k) for k, v in data.items()}
  try:
    return cls(**kwargs)
  except ValueError as e:
    # Section checks name their full key ("train.learning_rate ..."); others get the section prefixed.
    section = path.rstrip(".")
    message = str(e) if not section or str(e).startswith(section) else f"{section}: {e}"
    raise ConfigError(message) from e


def _convert(tp, value, key: str):
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if dataclasses.is_dataclass(tp):
    return from_dict(tp, value, key + ".")
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
      try:
        return _convert(arg, value, key)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(f"{key}: {value!r} matches none of {tp}: {errors}")
  if origin is Literal:
    if value not in args:
      raise ValueError(f"{key} must be one of {list(args)}, got {value!r}")
    return value
  if origin in (tuple, Sequence, list) or tp in (tuple, list):
    if not isinstance(value, (list, tuple)):
      raise ValueError(f"{key} must be a list, got {value!r}")
    item = args[0] if args else Any
    return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
  if tp is Any:
    return value
  if tp is bool:
    if not isinstance(value, bool):
      raise ValueError(f"{key} must be true or false, got {value!r}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{key} must be an integer, got {value!r}")
    return value
  if tp is float:
    if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
      try:
        return float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ValueError(f"{key} must be a string, got {value!r}")
    return value
  raise TypeError(f"{key}: unsupported annotation {tp}")


def to_dict(obj) -> dict[str, Any]:
  """The plain nested dict (tuples as lists): what `from_dict` reads back, and what a run saves."""

  def plain(x):
    if dataclasses.is_dataclass(x):
      return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
      return [plain(v) for v in x]
    return x

  return plain(obj)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """`["train.lr=1e-5", "rollout.backend=dense"]` onto a nested dict (values parsed as YAML scalars)."""
  data = dict(data)
  for item in overrides:
    key, sep, raw = item.partition("=")
    if not sep or not key:
      raise ValueError(f"override {item!r} is not key.sub=value")
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
      child = node.get(p)
      node[p] = dict(child) if isinstance(child, dict) else {}
      node = node[p]
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
  return data


def load(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
  """`cls` from an optional YAML file, then command-line overrides; every value type-checked and
  range-checked. Any problem is a ConfigError naming the key (or the file)."""
  return build(cls, read(path, overrides))


def given_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
  """The dotted keys a raw config dict sets (`read`'s output): ["train.beta", "env.name", ...]."""
  keys = []
  for k, v in data.items():
    if isinstance(v, dict) and v:
      keys += given_keys(v, f"{prefix}{k}.")
    else:
      keys.append(f"{prefix}{k}")
  return keys


def build(cls: type[T], data: dict[str, Any]) -> T:
  """`cls` from a raw dict (`read`'s): a ConfigError naming the key on any problem."""
  try:
    return from_dict(cls, data)
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from e


def read(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """The raw nested dict of an optional YAML file with the overrides applied (nothing checked yet
  but the file and the override syntax): what the config sets, before defaults fill the rest."""
  data: dict[str, Any] = {}
  if path is not None:
    try:
      with open(path) as f:
        data = yaml.safe_load(f) or {}
    except OSError as e:
      raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
      raise ConfigError(f"the config file {path} is not valid YAML: {e}") from e
  if not isinstance(data, dict):
    raise ConfigError(f"the config file {path} must hold a mapping, got {type(data).__name__}")
  try:
    return apply_overrides(data, overrides)
  except ValueError as e:
    raise ConfigError(str(e)) from e


def dump(obj, path: str | os.PathLike) -> None:
  """Writes `obj` (a config tree) to `path` as YAML, in `from_dict`'s form: what a run saves."""
  with open(path, "w") as f:
    yaml.safe_dump(to_dict(obj), f, sort_keys=False)


def read_json_object(path: str) -> dict:
  """A JSON file's object; a truncated or half-written file is a ValueError naming it."""
  try:
    with open(path) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e}): truncated or half-written?") from e
  if not isinstance(data, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
  return data
