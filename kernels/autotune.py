"""Autotuner: per op and shape bucket, the measured-fastest *correct* implementation and blocks.

For each bucket it runs every candidate (XLA reference, Triton ``pallas``, ``mosaic_gpu``, each with
block configurations), checks the candidate's outputs against the reference under the tolerance table
(``bench.tolerances``), times the ones that pass, and records the winner and every candidate's timing in
a versioned JSON per device kind under ``kernels/tuning/`` (device kind, jax version, date, commit).

``impl="auto"`` and default blocks read that cache through :func:`resolve`; a device or bucket that is
absent falls back to the heuristics (``impl="auto"``: xla on CPU, the kernel elsewhere; the blocks'
``default_blocks``). A candidate that fails parity is recorded but can never win.

A tune is built to finish inside a short GPU slice and to keep what it did when it does not: each
problem times the current heuristic (``impl="auto"``, default blocks) first as the baseline, prints a
line per candidate as it is timed, stops trying candidates once its op's time budget is spent (the rest
are recorded as not tried), and the cache file is rewritten (atomically) after every problem.
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
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from kernels import backend

SCHEMA = 1
TUNING_DIR = Path(__file__).parent / "tuning"
OPS = ("grpo_loss", "paged_attention", "optim", "fused_linear")
HEURISTIC = "heuristic"  # the baseline row: what impl="auto" with default blocks runs today

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
  if op == "optim":  # a whole parameter tree per rule: its size decides launch count vs bandwidth
    return f"{shape['rule']}/{shape['dtype']}/p{_pow2(shape['params'])}"
  if op == "fused_linear":
    return f"{shape['dtype']}/n{_pow2(shape['tokens'])}/h{shape['hidden']}/v{shape['vocab']}"
  raise ValueError(f"op must be one of {OPS}, got {op!r}")


# ----------------------------------------------------------------------------------- blocks <-> JSON
@dataclasses.dataclass(frozen=True)
class ChunkBlocks:
  """The chunked fused LM-head path's one tile: tokens per chunk (``chunk_size``)."""

  chunk_size: int

  def __post_init__(self):
    if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
      raise ValueError(f"ChunkBlocks.chunk_size must be a positive int, got {self.chunk_size!r}")


def _blocks_types():
  from kernels.fused_linear.blocks import LinearBlocks
  from kernels.fused_linear.mosaic_gpu import MosaicLinearBlocks
  from kernels.grpo_loss.blocks import LossBlocks
  from kernels.grpo_loss.mosaic_cluster import ClusterLossBlocks
  from kernels.grpo_loss.mosaic_gpu import MosaicLossBlocks
  from kernels.optim.multi import MultiTensorBlocks
  from kernels.optim.pallas import ElementwiseBlocks
  from kernels.paged_attention.blocks import PagedBlocks
  from kernels.paged_attention.mosaic_gpu import MosaicPagedBlocks

  return {
    # TPU tiles (ElementwiseBlocks) or the GPU multi-tensor launch (MultiTensorBlocks)
    ("optim", "pallas"): (ElementwiseBlocks, MultiTensorBlocks),
    ("fused_linear", "pallas"): LinearBlocks,
    ("fused_linear", "mosaic_gpu"): MosaicLinearBlocks,
    ("fused_linear", "chunked"): ChunkBlocks,
    ("grpo_loss", "pallas"): LossBlocks,
    # the row kernel's tiles, or the cluster-split kernels' (rows, cluster, chunk)
    ("grpo_loss", "mosaic_gpu"): (MosaicLossBlocks, ClusterLossBlocks),
    ("paged_attention", "pallas"): PagedBlocks,
    ("paged_attention", "mosaic_gpu"): MosaicPagedBlocks,
  }


def blocks_to_json(blocks) -> dict | None:
  return None if blocks is None else dataclasses.asdict(blocks)


def blocks_from_json(op: str, impl: str, data: dict | None):
  if data is None:
    return None
  types = _blocks_types()[(op, impl)]
  if isinstance(types, tuple):  # one impl, per-backend blocks: the class whose fields the data has
    types = next(c for c in types if set(data) == {f.name for f in dataclasses.fields(c)})
  return types(**data)


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


def apply_checked(op: str, impl: str, blocks, entry: dict | None, legal=None):
  """:func:`apply_entry`, but an entry that cannot be applied (a stale or hand-edited cache: fields
  or impls that no longer exist) or tuned ``(impl, blocks)`` that ``legal(impl, blocks)`` rejects
  (ValueError / TypeError) give back the caller's ``(impl, blocks)`` with a warning: a bad cache
  costs speed, never a failed call or an illegal kernel."""
  try:
    tuned = apply_entry(op, impl, blocks, entry)
    if legal is not None and tuned != (impl, blocks):
      legal(*tuned)
    return tuned
  except (ValueError, TypeError, KeyError, AttributeError, StopIteration) as e:
    warnings.warn(
      f"ignoring the tuned {op} entry (the heuristic runs instead): {type(e).__name__}: {e}",
      stacklevel=2,
    )
    return impl, blocks


def resolve_checked(op: str, impl: str, blocks, target: backend.Target, shape: dict, legal=None):
  """:func:`resolve` through :func:`apply_checked`; an unreadable or corrupt cache file is ignored
  with a warning (the caller's arguments, which the heuristics then fill)."""
  if target.interpret or target.platform != backend.host_platform():
    return impl, blocks
  return from_cache_checked(op, impl, blocks, shape, legal)


def from_cache_checked(op: str, impl: str, blocks, shape: dict, legal=None):
  """:func:`apply_checked` with this host's device's entry at ``shape``, whatever the target."""
  try:
    entry = lookup(op, shape)
  except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
    warnings.warn(f"ignoring the tuning cache ({type(e).__name__}: {e})", stacklevel=2)
    return impl, blocks
  return apply_checked(op, impl, blocks, entry, legal)


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
  """One op at one shape: inputs, the reference, the parity checks (``bench.cases.Check``), and the
  op as it runs today (``impl="auto"``, default blocks), timed first as the baseline."""

  op: str
  shape: dict  # the bucket's fields (see :func:`bucket`)
  make_inputs: Callable[[], tuple]
  reference: Callable
  checks: tuple
  heuristic: Callable | None = None


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
  """Worst parity error over the checks (<= 1 is within tolerance; inf on a NaN mismatch), reduced on
  the device by the bench's own implementation (only scalars reach the host)."""
  from bench.harness import device_parity

  return max(device_parity(actual, expected, checks).values(), default=0.0)


def _try(cand: Candidate, args, expected, checks, repeats: int) -> dict:
  row = dict(impl=cand.impl, blocks=blocks_to_json(cand.blocks), label=cand.label)
  try:
    fn = jax.jit(cand.fn)
    err = _parity(fn(*args), expected, checks)
    row.update(parity_error=err if math.isfinite(err) else None, ok=bool(err <= 1.0))
    row["time_s"] = _timed(fn, args, repeats) if row["ok"] else None
  except Exception as e:  # an illegal config is a recorded loss, not a crash of the whole run
    row.update(parity_error=None, ok=False, time_s=None, error=f"{type(e).__name__}: {e}"[:300])
  return row


def _row_line(op_bucket: str, row: dict, took: float) -> str:
  if row.get("skipped"):
    return f"  {op_bucket} {row['label']}: not tried ({row['skipped']})"
  if not row["ok"]:
    why = row.get("error") or f"parity {row['parity_error']}"
    return f"  {op_bucket} {row['label']}: FAILED {why} ({took:.1f} s)"
  return (
    f"  {op_bucket} {row['label']}: {row['time_s'] * 1e3:.3f} ms, parity "
    f"{row['parity_error']:.2g} ({took:.1f} s)"
  )


def tune_problem(
  problem: Problem,
  candidates: Sequence[Candidate],
  repeats: int = 5,
  *,
  deadline: float | None = None,
  log: Callable[[str], None] = lambda line: None,
) -> dict:
  """Check and time the heuristic, then every candidate on ``problem``; the fastest passing candidate
  wins (None if none; the heuristic row is the baseline, never the winner). Candidates not started by
  ``deadline`` (``time.perf_counter()`` seconds) are recorded as not tried."""
  args = problem.make_inputs()
  expected = jax.block_until_ready(jax.jit(problem.reference)(*args))
  where = f"{problem.op} {bucket(problem.op, problem.shape)}"
  todo = [Candidate(HEURISTIC, None, problem.heuristic)] if problem.heuristic else []
  rows = []
  for cand in [*todo, *candidates]:
    t0 = time.perf_counter()
    if deadline is not None and t0 > deadline and cand.impl != HEURISTIC:
      row = dict(impl=cand.impl, blocks=blocks_to_json(cand.blocks), label=cand.label, ok=False)
      row.update(parity_error=None, time_s=None, skipped="the op's time budget was spent")
    else:
      row = _try(cand, args, expected, problem.checks, repeats)
    rows.append(row)
    log(_row_line(where, row, time.perf_counter() - t0))
  del args, expected
  jax.clear_caches()  # the candidates' executables: the next problem starts from an empty device
  base = next((r for r in rows if r["impl"] == HEURISTIC), None)
  passing = [r for r in rows if r["ok"] and r["impl"] != HEURISTIC]
  winner = min(passing, key=lambda r: r["time_s"]) if passing else None
  entry = dict(
    shape=problem.shape,
    winner=None if winner is None else dict(impl=winner["impl"], blocks=winner["blocks"]),
    candidates=[r for r in rows if r["impl"] != HEURISTIC],
  )
  if base is not None:
    entry["heuristic"] = base
  return entry


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
  budget_s: float | None = None,
) -> Path:
  """Tune every problem and merge the results into the device's cache file, rewritten after each
  problem (a killed tune keeps what it finished); returns its path. ``budget_s``: seconds per op
  (counted from its first problem) after which its remaining candidates are not tried."""
  kind = kind or device_kind()
  path = cache_path(kind, directory)
  data = _load_file(path) or dict(schema=SCHEMA, entries={})
  deadlines: dict[str, float | None] = {}
  for problem in problems:
    if problem.op not in deadlines:
      deadlines[problem.op] = None if budget_s is None else time.perf_counter() + budget_s
      log(f"[tune] {problem.op}" + ("" if budget_s is None else f" (budget {budget_s:.0f} s)"))
    cands = candidates_for(problem)
    entry = tune_problem(problem, cands, repeats, deadline=deadlines[problem.op], log=log)
    data["entries"].setdefault(problem.op, {})[bucket(problem.op, problem.shape)] = entry
    log(f"[tune] {problem.op} {bucket(problem.op, problem.shape)}: winner {entry['winner']}")
    _write(path, data, kind, repeats)
  if not problems:
    _write(path, data, kind, repeats)
  return path


def _write(path: Path, data: dict, kind: str, repeats: int) -> None:
  data.update(
    repeats=repeats,
    device_kind=kind,
    platform=backend.host_platform(),
    jax_version=jax.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    commit=_commit(),
  )
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")
  tmp.replace(path)  # atomic: a tune killed mid-write leaves the previous cache
  _load.cache_clear()
