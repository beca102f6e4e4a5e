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

import dataclasses
import datetime
import json
import math
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from kernels import backend

# the cache's data half lives in kernels.autotune_cache; its names stay importable from here
from kernels.autotune_cache import (  # noqa: F401
  HEURISTIC,
  OPS,
  SCHEMA,
  TUNING_DIR,
  ChunkBlocks,
  _load,
  _load_file,
  blocks_from_json,
  blocks_to_json,
  bucket,
  cache_dir,
  cache_path,
  device_kind,
  lookup,
  use_cache_dir,
)


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


def resolve(op: str, impl: str, blocks, target: backend.Target, shape: dict):
  """(impl, blocks) for one call: what the caller passed, with ``impl="auto"`` and ``blocks=None``
  filled from the tuned cache of the target's device kind (:func:`_cache_kind`) when it has an entry
  for ``shape``; the arguments unchanged otherwise, so the ops' heuristics apply."""
  kind = _cache_kind(target)
  return (impl, blocks) if kind is None else apply_entry(op, impl, blocks, lookup(op, shape, kind))


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
  kind = _cache_kind(target)
  if kind is None:
    return impl, blocks
  return from_cache_checked(op, impl, blocks, shape, legal, kind)


def from_cache_checked(op: str, impl: str, blocks, shape: dict, legal=None, kind=None):
  """:func:`apply_checked` with ``kind``'s (default: this host's device's) entry at ``shape``."""
  try:
    entry = lookup(op, shape, kind)
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
  ideal_bytes: float | None = None  # the op's ideal HBM traffic (a modelled search's memory floor)


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
  from bench.kernels.harness import device_parity

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
  evaluate: Callable | None = None,
  source: str = "measured",
) -> Path:
  """Tune every problem and merge the results into the device's cache file, rewritten after each
  problem (a killed tune keeps what it finished); returns its path. ``budget_s``: seconds per op
  (counted from its first problem) after which its remaining candidates are not tried.

  ``evaluate(problem, candidates, deadline, log) -> entry`` replaces the measuring search
  (:func:`tune_problem`): ``bench.tune --target`` compiles each candidate for a TPU generation and
  ranks by modelled time, with ``source="modelled"``. A measured entry always wins: a modelled one
  never replaces it (a measured one replaces anything)."""
  kind = kind or device_kind()
  path = cache_path(kind, directory)
  data = _load_file(path) or dict(schema=SCHEMA, entries={})
  deadlines: dict[str, float | None] = {}
  for problem in problems:
    if problem.op not in deadlines:
      deadlines[problem.op] = None if budget_s is None else time.perf_counter() + budget_s
      log(f"[tune] {problem.op}" + ("" if budget_s is None else f" (budget {budget_s:.0f} s)"))
    cands = candidates_for(problem)
    if evaluate is None:
      entry = tune_problem(problem, cands, repeats, deadline=deadlines[problem.op], log=log)
    else:
      entry = evaluate(problem, cands, deadlines[problem.op], log)
    entry["source"] = source
    key = bucket(problem.op, problem.shape)
    old = data["entries"].setdefault(problem.op, {}).get(key)
    if old is not None and old.get("source", "measured") == "measured" and source != "measured":
      log(f"[tune] {problem.op} {key}: kept the measured entry (a modelled one never replaces it)")
    else:
      data["entries"][problem.op][key] = entry
    log(f"[tune] {problem.op} {key}: {source} winner {entry['winner']}")
    _write(path, data, kind, repeats)
  if not problems:
    _write(path, data, kind, repeats)
  return path


def _write(path: Path, data: dict, kind: str, repeats: int) -> None:
  sources = {e.get("source", "measured") for op in data["entries"].values() for e in op.values()}
  data.update(
    repeats=repeats,
    device_kind=kind,
    sources=sorted(sources),  # "modelled": compiled for the device kind on a host without it
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
