"""The autotuner's measuring half: check and time each candidate an op's table offers, and write the
winner into the tuning cache (:mod:`kernels.autotune`, which ``impl="auto"`` reads).

For each problem (one op at one shape: the bench's inputs, reference and parity checks) it runs the
op as it runs today first (``impl="auto"``, default blocks: the baseline), then every candidate,
checks the candidate's outputs against the reference under the tolerance table (on the device:
:func:`bench.kernels.harness.device_parity`), times the ones that pass and records the winner and every
candidate's timing in the device kind's cache file (device kind, jax version, date, commit).

A tune is built to finish inside a short GPU slice and to keep what it did when it does not: a line
per candidate is printed as it is timed, an op stops trying candidates once its time budget is spent
(the rest are recorded as not tried), and the cache file is rewritten (atomically) after every
problem.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from bench.kernels.harness import device_parity
from kernels import autotune, backend
from kernels.ops import Op


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
  """One op (its table) at one shape: inputs, the reference, the parity checks
  (``bench.kernels.cases.Check``), and the op as it runs today (``impl="auto"``, default blocks), timed
  first as the baseline."""

  op: Op
  shape: dict  # the bucket's fields (the op's ``bucket``)
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
  the device (only scalars reach the host)."""
  return max(device_parity(actual, expected, checks).values(), default=0.0)


def _try(cand: Candidate, args, expected, checks, repeats: int) -> dict:
  row = dict(impl=cand.impl, blocks=autotune.blocks_to_json(cand.blocks), label=cand.label)
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
  where = f"{problem.op.name} {problem.op.bucket(problem.shape)}"
  heuristic = autotune.HEURISTIC
  todo = [Candidate(heuristic, None, problem.heuristic)] if problem.heuristic else []
  rows = []
  for cand in [*todo, *candidates]:
    t0 = time.perf_counter()
    if deadline is not None and t0 > deadline and cand.impl != heuristic:
      row = dict(impl=cand.impl, blocks=autotune.blocks_to_json(cand.blocks), label=cand.label)
      row.update(ok=False, parity_error=None, time_s=None, skipped="the op's time budget was spent")
    else:
      row = _try(cand, args, expected, problem.checks, repeats)
    rows.append(row)
    log(_row_line(where, row, time.perf_counter() - t0))
  del args, expected
  jax.clear_caches()  # the candidates' executables: the next problem starts from an empty device
  base = next((r for r in rows if r["impl"] == heuristic), None)
  passing = [r for r in rows if r["ok"] and r["impl"] != heuristic]
  winner = min(passing, key=lambda r: r["time_s"]) if passing else None
  entry = dict(
    shape=problem.shape,
    winner=None if winner is None else dict(impl=winner["impl"], blocks=winner["blocks"]),
    candidates=[r for r in rows if r["impl"] != heuristic],
  )
  if base is not None:
    entry["heuristic"] = base
  return entry


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
  kind = kind or autotune.device_kind()
  path = autotune.cache_path(kind, directory)
  data = autotune.load_file(path) or dict(schema=autotune.SCHEMA, entries={})
  deadlines: dict[str, float | None] = {}
  for problem in problems:
    name = problem.op.name
    if name not in deadlines:
      deadlines[name] = None if budget_s is None else time.perf_counter() + budget_s
      log(f"[tune] {name}" + ("" if budget_s is None else f" (budget {budget_s:.0f} s)"))
    cands = candidates_for(problem)
    if evaluate is None:
      entry = tune_problem(problem, cands, repeats, deadline=deadlines[name], log=log)
    else:
      entry = evaluate(problem, cands, deadlines[name], log)
    entry["source"] = source
    key = problem.op.bucket(problem.shape)
    old = data["entries"].setdefault(name, {}).get(key)
    if old is not None and old.get("source", "measured") == "measured" and source != "measured":
      log(f"[tune] {name} {key}: kept the measured entry (a modelled one never replaces it)")
    else:
      data["entries"][name][key] = entry
    log(f"[tune] {name} {key}: {source} winner {entry['winner']}")
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
  autotune.store(path, data)


def _commit() -> str | None:
  try:
    out = subprocess.run(
      ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    )
  except OSError:
    return None
  return out.stdout.strip() or None
