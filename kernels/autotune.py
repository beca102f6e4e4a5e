"""The autotuner's cache and how a call reads it: per op and shape bucket, the measured-fastest
*correct* implementation and blocks, in a versioned JSON per device kind under ``kernels/tuning/``.

``bench.tune`` (its search: ``bench.kernels.autotune_search``) runs every candidate an op's table offers
(:meth:`kernels.ops.Op.candidates`), checks its outputs against the reference under the tolerance
table, times the ones that pass and records the winner and every candidate's timing here (device
kind, jax version, date, commit). A candidate that fails parity is recorded but can never win.

``impl="auto"`` and default blocks read that cache through :func:`resolve`, which an op's
:meth:`kernels.ops.Op.resolve` calls; a device or bucket that is absent leaves the caller's
arguments, which the op's heuristics then fill (``impl="auto"``: its table's platform default; the
blocks: the impl's heuristic). A stale or hand-edited entry (fields or impls that no longer exist,
blocks its table calls illegal at this shape) or an unreadable file is ignored with a warning: a bad
cache costs speed, never a failed call or an illegal kernel.

Nothing here knows an op: each is passed in as its table (:class:`kernels.ops.Op`: its ``name``,
``bucket``, ``blocks_from_json`` and ``check_tuned``), so the ops import this module, never the
reverse.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import re
import warnings
from pathlib import Path

import jax

from kernels import backend

SCHEMA = 1
TUNING_DIR = Path(__file__).parent / "tuning"
HEURISTIC = "heuristic"  # the baseline row: what impl="auto" with default blocks runs today

_CACHE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("tuning_dir", default=None)


# ------------------------------------------------------------------------------ reading for a call
def _cache_kind(target: backend.Target) -> str | None:
  """The device kind whose cache a call on ``target`` reads, or None (no cache applies).

  A real target on this host's own platform reads its device's cache: timings of one device say
  nothing about another, nor about the interpreter. A TPU target of a named generation compiled on
  a host without a TPU reads that generation's cache (modelled entries, from ``python -m bench.tune
  --target``, or measured ones copied from a TPU): the cache is per device kind either way."""
  if target.interpret:
    return None
  if target.platform == backend.host_platform():
    return device_kind()
  if target.platform == "tpu" and target.tpu is not None:
    return target.tpu.device_kind
  return None


def resolve(op, impl: str, blocks, target: backend.Target, shape: dict):
  """(impl, blocks) for one call of ``op`` (its table): what the caller passed, with ``impl="auto"``
  and ``blocks=None`` filled from the tuned cache of the target's device kind (:func:`_cache_kind`)
  when it has an entry for ``shape`` that the table accepts (:meth:`kernels.ops.Op.check_tuned`);
  the arguments unchanged otherwise, so the op's heuristics apply. An unreadable or corrupt cache
  file is ignored with a warning."""
  kind = _cache_kind(target)
  if kind is None:
    return impl, blocks
  return from_cache(op, impl, blocks, shape, op.check_tuned(target, shape), kind)


def from_cache(op, impl: str, blocks, shape: dict, legal=None, kind: str | None = None):
  """:func:`apply_checked` with ``kind``'s (default: this host's device's) entry at ``shape``; an
  unreadable or corrupt cache file is ignored with a warning."""
  try:
    entry = lookup(op, shape, kind)
  except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
    warnings.warn(f"ignoring the tuning cache ({type(e).__name__}: {e})", stacklevel=4)
    return impl, blocks
  return apply_checked(op, impl, blocks, entry, legal)


def apply_entry(op, impl: str, blocks, entry: dict | None):
  """:func:`resolve`'s rule for one cache entry: ``auto`` without blocks becomes the winner and its
  blocks; an explicit impl without blocks gets that impl's fastest passing blocks (an impl that
  takes none keeps none); given blocks stay."""
  if entry is None or entry.get("winner") is None:
    return impl, blocks
  winner = entry["winner"]
  if impl == "auto":
    if blocks is None:  # caller's blocks are for the heuristic's impl: then leave "auto" alone
      impl = winner["impl"]
      blocks = op.blocks_from_json(impl, winner.get("blocks"))
  elif blocks is None and op[impl].blocks:  # the fastest passing blocks measured for this impl
    ok = [c for c in entry["candidates"] if c["impl"] == impl and c["ok"] and c["blocks"]]
    if ok:
      best = min(ok, key=lambda c: c["time_s"])
      blocks = op.blocks_from_json(impl, best["blocks"])
  return impl, blocks


def apply_checked(op, impl: str, blocks, entry: dict | None, legal=None):
  """:func:`apply_entry`, but an entry that cannot be applied (a stale or hand-edited cache: fields
  or impls that no longer exist) or tuned ``(impl, blocks)`` that ``legal(impl, blocks)`` rejects
  (ValueError / TypeError) give back the caller's ``(impl, blocks)`` with a warning."""
  try:
    tuned = apply_entry(op, impl, blocks, entry)
    if legal is not None and tuned != (impl, blocks):
      legal(*tuned)
    return tuned
  except (ValueError, TypeError, KeyError, AttributeError, StopIteration) as e:
    warnings.warn(
      f"ignoring the tuned {op.name} entry (the heuristic runs instead): {type(e).__name__}: {e}",
      stacklevel=3,
    )
    return impl, blocks


# ----------------------------------------------------------------------------------- the cache file
@contextlib.contextmanager
def use_cache_dir(path):
  """Read and write tuning caches under ``path`` inside the block (tests; ``bench.device``'s run)."""
  token = _CACHE_DIR.set(Path(path))
  _load.cache_clear()
  try:
    yield
  finally:
    _CACHE_DIR.reset(token)
    _load.cache_clear()


def cache_dir() -> Path:
  return _CACHE_DIR.get() or TUNING_DIR


def device_kind() -> str:
  return jax.devices()[0].device_kind


def cache_path(kind: str, directory: Path | None = None) -> Path:
  slug = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"
  return (directory or cache_dir()) / f"{slug}.json"


def blocks_to_json(blocks) -> dict | None:
  return None if blocks is None else dataclasses.asdict(blocks)


def load_file(path: Path) -> dict | None:
  """A cache file's data, or None when it is missing or of an older layout (ignored, not misread)."""
  if not path.exists():
    return None
  data = json.loads(path.read_text())
  if data.get("schema") != SCHEMA:
    return None
  return data


def store(path: Path, data: dict) -> None:
  """Write a cache file atomically (a tune killed mid-write leaves the previous one) and forget the
  memoised reads."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")
  tmp.replace(path)
  _load.cache_clear()


class _Loader:
  """Memoised cache reads, cleared when the cache directory changes or a cache is written."""

  def __init__(self):
    self._memo: dict[tuple[str, str], dict | None] = {}

  def __call__(self, kind: str) -> dict | None:
    key = (kind, str(cache_dir()))
    if key not in self._memo:
      self._memo[key] = load_file(cache_path(kind, Path(key[1])))
    return self._memo[key]

  def cache_clear(self):
    self._memo.clear()


_load = _Loader()


def lookup(op, shape: dict, kind: str | None = None) -> dict | None:
  """The cached entry (``winner`` and ``candidates``) of ``op`` at ``shape`` on ``kind`` (default:
  this host's device), or None."""
  data = _load(kind or device_kind())
  if data is None:
    return None
  return data.get("entries", {}).get(op.name, {}).get(op.bucket(shape))
