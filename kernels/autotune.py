"""Autotuner: per op and shape bucket, the measured-fastest *correct* implementation and blocks.

For each bucket it runs every candidate (XLA reference, Triton ``pallas``, ``mosaic_gpu``, each with
block configurations), checks the candidate's outputs against the reference under the tolerance table
(``bench.tolerances``), times the ones that pass, and records the winner and every candidate's timing in
a versioned JSON per device kind under ``kernels/tuning/`` (device kind, jax version, date, commit).

``impl="auto"`` and default blocks read that cache through :func:`resolve`; a device or bucket that is
absent falls back to the heuristics (``impl="auto"``: xla on CPU, the kernel elsewhere; the blocks'
``default_blocks``). A candidate that fails parity is recorded but can never win.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import json
import math
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from kernels import backend

SCHEMA = 1
TUNING_DIR = Path(__file__).parent / "tuning"
OPS = ("grpo_loss", "paged_attention")

_CACHE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("tuning_dir", default=None)


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


# ------------------------------------------------------------------------------------ shape buckets
def _pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def bucket(op: str, shape: dict) -> str:
  """The cache key of one problem. Token / batch / context counts are rounded up to powers of two
  (timings scale smoothly there); vocabulary, heads, head_dim and page size are exact (they change
  which blocks are legal)."""
  if op == "grpo_loss":
    return f"{shape['dtype']}/n{_pow2(shape['tokens'])}/v{shape['vocab']}"
  if op == "paged_attention":
    return (
      f"{shape['dtype']}/b{_pow2(shape['batch'])}/hq{shape['q_heads']}/hkv{shape['kv_heads']}"
      f"/d{shape['head_dim']}/ps{shape['page_size']}/ctx{_pow2(shape['ctx'])}"
    )
  raise ValueError(f"op must be one of {OPS}, got {op!r}")


# ----------------------------------------------------------------------------------- blocks <-> JSON
def _blocks_types():
  from kernels.grpo_loss.blocks import LossBlocks
  from kernels.grpo_loss.mosaic_gpu import MosaicLossBlocks
  from kernels.paged_attention.blocks import PagedBlocks
  from kernels.paged_attention.mosaic_gpu import MosaicPagedBlocks

  return {
    ("grpo_loss", "pallas"): LossBlocks,
    ("grpo_loss", "mosaic_gpu"): MosaicLossBlocks,
    ("paged_attention", "pallas"): PagedBlocks,
    ("paged_attention", "mosaic_gpu"): MosaicPagedBlocks,
  }


def blocks_to_json(blocks) -> dict | None:
  return None if blocks is None else dataclasses.asdict(blocks)


def blocks_from_json(op: str, impl: str, data: dict | None):
  if data is None:
    return None
  return _blocks_types()[(op, impl)](**data)


# ------------------------------------------------------------------------------------------ reading
def _load_file(path: Path) -> dict | None:
  if not path.exists():
    return None
  data = json.loads(path.read_text())
  if data.get("schema") != SCHEMA:  # an older layout: ignore rather than misread
    return None
  return data


def _load_uncached(kind: str, directory: str) -> dict | None:
  return _load_file(cache_path(kind, Path(directory)))


class _Loader:
  """Memoised cache reads, cleared when the cache directory changes or a cache is written."""

  def __init__(self):
    self._memo: dict[tuple[str, str], dict | None] = {}

  def __call__(self, kind: str) -> dict | None:
    key = (kind, str(cache_dir()))
    if key not in self._memo:
      self._memo[key] = _load_uncached(*key)
    return self._memo[key]

  def cache_clear(self):
    self._memo.clear()


_load = _Loader()


def lookup(op: str, shape: dict, kind: str | None = None) -> dict | None:
  """The cached entry (``winner`` and ``candidates``) of ``op`` at ``shape`` on ``kind``, or None."""
  data = _load(kind or device_kind())
  if data is None:
    return None
  return data.get("entries", {}).get(op, {}).get(bucket(op, shape))


def resolve(op: str, impl: str, blocks, target: backend.Target, shape: dict):
  """(impl, blocks) for one call: what the caller passed, with ``impl="auto"`` and ``blocks=None``
  filled from the tuned cache of this host's device when there is an entry for ``shape``.

  Only a real (non-interpreted) target on this host's own platform reads the cache: timings of one
  device say nothing about another, nor about the interpreter. Returns the arguments unchanged
  otherwise, so the ops' heuristics apply.
  """
  if target.interpret or target.platform != backend.host_platform():
    return impl, blocks
  return apply_entry(op, impl, blocks, lookup(op, shape))


def apply_entry(op: str, impl: str, blocks, entry: dict | None):
  """:func:`resolve`'s rule for one cache entry: ``auto`` without blocks becomes the winner and its
  blocks; an explicit impl without blocks gets that impl's fastest passing blocks; given blocks stay."""
  if entry is None or entry.get("winner") is None:
    return impl, blocks
  winner = entry["winner"]
  if impl == "auto":
    if blocks is None:  # caller's blocks are for the heuristic's impl: then leave "auto" alone
      impl = winner["impl"]
      blocks = blocks_from_json(op, impl, winner.get("blocks"))
  elif blocks is None and impl != "xla":  # the fastest passing blocks measured for this impl
    ok = [c for c in entry["candidates"] if c["impl"] == impl and c["ok"] and c["blocks"]]
    if ok:
      best = min(ok, key=lambda c: c["time_s"])
      blocks = blocks_from_json(op, impl, best["blocks"])
  return impl, blocks


# ------------------------------------------------------------------------------------------- tuning
@dataclasses.dataclass(frozen=True)
class Candidate:
  """One implementation + blocks to try; ``fn`` maps the problem's inputs to outputs comparable with
  the reference's (same pytree)."""

  impl: str
  blocks: object
  fn: Callable

  @property
  def label(self) -> str:
    return self.impl if self.blocks is None else f"{self.impl}:{self.blocks}"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One op at one shape: inputs, the reference, the parity checks (``bench.cases.Check``)."""

  op: str
  shape: dict  # the bucket's fields (see :func:`bucket`)
  make_inputs: Callable[[], tuple]
  reference: Callable
  checks: tuple


def _timed(fn, args, repeats: int) -> float:
  """Median wall time of ``repeats`` calls after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _parity(actual, expected, checks) -> float:
  """Worst parity error over the checks (<= 1 is within tolerance; inf on a NaN mismatch)."""
  from bench.tolerances import parity_error

  flat_a, flat_e = jax.tree.leaves(actual), jax.tree.leaves(expected)
  worst = 0.0
  for c in checks:
    for i in c.index if isinstance(c.index, tuple) else (c.index,):
      worst = max(worst, parity_error(flat_a[i], flat_e[i], c.quantity, c.dtype, c.reduction_len))
  return worst


def tune_problem(problem: Problem, candidates: Sequence[Candidate], repeats: int = 5) -> dict:
  """Check and time every candidate on ``problem``; the fastest passing one wins (None if none)."""
  args = problem.make_inputs()
  expected = jax.jit(problem.reference)(*args)
  rows = []
  for cand in candidates:
    row = dict(impl=cand.impl, blocks=blocks_to_json(cand.blocks), label=cand.label)
    try:
      fn = jax.jit(cand.fn)
      err = _parity(fn(*args), expected, problem.checks)
      row.update(parity_error=err if math.isfinite(err) else None, ok=bool(err <= 1.0))
      row["time_s"] = _timed(fn, args, repeats) if row["ok"] else None
    except Exception as e:  # an illegal config is a recorded loss, not a crash of the whole run
      row.update(parity_error=None, ok=False, time_s=None, error=f"{type(e).__name__}: {e}"[:300])
    rows.append(row)
  passing = [r for r in rows if r["ok"]]
  winner = min(passing, key=lambda r: r["time_s"]) if passing else None
  return dict(
    shape=problem.shape,
    winner=None if winner is None else dict(impl=winner["impl"], blocks=winner["blocks"]),
    candidates=rows,
  )


def _commit() -> str | None:
  try:
    out = subprocess.run(
      ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    )
  except OSError:
    return None
  return out.stdout.strip() or None


def tune(
  problems: Sequence[Problem],
  candidates_for: Callable[[Problem], Sequence[Candidate]],
  *,
  kind: str | None = None,
  directory: Path | None = None,
  repeats: int = 5,
  log: Callable[[str], None] = print,
) -> Path:
  """Tune every problem and merge the results into the device's cache file; returns its path."""
  kind = kind or device_kind()
  path = cache_path(kind, directory)
  data = _load_file(path) or dict(schema=SCHEMA, entries={})
  for problem in problems:
    entry = tune_problem(problem, candidates_for(problem), repeats)
    data["entries"].setdefault(problem.op, {})[bucket(problem.op, problem.shape)] = entry
    win = entry["winner"]
    log(f"{problem.op} {bucket(problem.op, problem.shape)}: winner {win}")
  data.update(
    repeats=repeats,
    device_kind=kind,
    platform=backend.host_platform(),
    jax_version=jax.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    commit=_commit(),
  )
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")
  _load.cache_clear()
  return path
