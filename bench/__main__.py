"""``python -m bench`` (what ``nox -s bench`` runs): every suite, kernel vs reference, one report.

Examples::

    python -m bench                                  # this backend's default size, every suite
    python -m bench --suite grpo_loss --size large   # real shapes (for a GPU / TPU)
    python -m bench --size small --size large        # both: time-vs-size curves over more shapes
    python -m bench --profile                        # also a jax.profiler trace in profiles/bench-<time>/

Writes ``bench/results/<device kind>-<time>/`` (e.g. ``cpu-20261123-101500``): results.json, summary.md, roofline.png,
time_vs_size.png and rollout.png. The ``mismatch`` suite adds each rollout engine's log-prob mismatch
against the trainer (bench/mismatch.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import pathlib
import re
import sys
import time

from tqdm import tqdm

from bench import loop as loop_bench
from bench import mismatch as mismatch_bench
from bench import report, roofline
from bench import rollout as rollout_bench
from bench.cases import SIZES, SUITES, all_cases
from bench.run import release, run_case
from kernels import backend

ROLLOUT = "rollout"  # the engine suite: tokens/s of paged vs dense generation (bench/rollout.py)
LOOP = "loop"  # the GRPO loop's step time, kept in bench/history/loop.jsonl (bench/loop.py)
MISMATCH = "mismatch"  # each engine's sampler log-probs against the trainer's (bench/mismatch.py)
PEERS = "peers"  # Liger-Kernel / tokamax beside our kernels (bench/cases/peers.py), each optional
ALL_SUITES = SUITES + (PEERS, ROLLOUT, MISMATCH, LOOP)
ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  suites: tuple[str, ...] | None = None  # None: every suite
  sizes: tuple[str, ...] | None = None  # None: ("small",) on CPU, ("large",) on GPU / TPU
  repeats: int = 10
  warmup: int = 2
  rollout_repeats: int = 3  # whole generate() calls per rollout backend and workload
  seed: int = 0
  measure_bandwidth: bool = True
  out: pathlib.Path | None = None  # default bench/results/<device kind>-<timestamp>
  profile: pathlib.Path | None = None  # capture a jax.profiler trace of the whole run here
  plots: bool = True
  history: pathlib.Path | None = loop_bench.HISTORY  # the loop suite's rows (None: keep none)
  memory_limit_gib: float | None = None  # skip cases XLA says need more (None: the device's limit)

  def __post_init__(self):
    if self.repeats < 1 or self.warmup < 0 or self.rollout_repeats < 1:
      raise ValueError("repeats and rollout_repeats must be >= 1 and warmup >= 0")
    if self.memory_limit_gib is not None and not self.memory_limit_gib > 0:
      raise ValueError(f"memory_limit_gib must be > 0, got {self.memory_limit_gib}")
    unknown = set(self.sizes or ()) - set(SIZES)
    if unknown:
      raise ValueError(f"size must be one of {SIZES}, got {sorted(unknown)}")
    unknown = set(self.suites or ()) - set(ALL_SUITES)
    if unknown:
      raise ValueError(f"suite must be one of {ALL_SUITES}, got {sorted(unknown)}")


def parse_args(argv=None) -> BenchConfig:
  p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
  p.add_argument(
    "--suite", action="append", choices=ALL_SUITES, help="repeatable; default: all suites"
  )
  p.add_argument(
    "--size", action="append", choices=SIZES, help="repeatable; default: small on CPU, else large"
  )
  p.add_argument("--repeats", type=int, default=BenchConfig.repeats)
  p.add_argument("--warmup", type=int, default=BenchConfig.warmup)
  p.add_argument("--rollout-repeats", type=int, default=BenchConfig.rollout_repeats)
  p.add_argument("--seed", type=int, default=BenchConfig.seed)
  p.add_argument("--no-measure-bandwidth", action="store_true", help="use datasheet peaks only")
  p.add_argument("--no-plots", action="store_true")
  p.add_argument(
    "--no-history", action="store_true", help="the loop suite compares and appends to no history"
  )
  p.add_argument("--out", type=pathlib.Path)
  p.add_argument(
    "--memory-limit-gib",
    type=float,
    help="skip a case whose XLA memory analysis needs more (default: the device's bytes_limit)",
  )
  p.add_argument(
    "--profile",
    nargs="?",
    type=pathlib.Path,
    const=pathlib.Path(""),
    default=None,
    metavar="DIR",
    help="capture a profiler trace (default DIR: profiles/bench-<time>)",
  )
  a = p.parse_args(argv)
  try:
    return BenchConfig(
      tuple(dict.fromkeys(a.suite)) if a.suite else None,
      tuple(dict.fromkeys(a.size)) if a.size else None,
      a.repeats,
      a.warmup,
      a.rollout_repeats,
      a.seed,
      not a.no_measure_bandwidth,
      a.out,
      a.profile,
      not a.no_plots,
      None if a.no_history else loop_bench.HISTORY,
      a.memory_limit_gib,
    )
  except ValueError as e:  # the message alone, exit status 2 (argparse's usage error)
    p.error(str(e))


def device_slug(device_kind: str) -> str:
  """A results folder's device part: jax's device kind, lower-case, runs of other characters as '-'
  ("cpu", "nvidia-h100-80gb-hbm3", "tpu-v5-lite")."""
  return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"


def _profiling(path: pathlib.Path | None, stamp: str):
  if path is None:
    return contextlib.nullcontext(None)
  from bench import trace

  return trace.capture(str(path if str(path) else ROOT / "profiles" / f"bench-{stamp}"))


def case_line(r) -> str:
  """One line per finished case (what a killed run's log shows last)."""
  if r.skipped:
    return f"{r.name}: skipped ({r.skipped})"
  if r.kernel is None:
    return f"{r.name}: FAILED {r.error}"
  worst = max(r.parity.values(), default=0.0)
  return (
    f"{r.name}: {'ok' if r.ok else 'PARITY FAILED'} kernel {r.kernel.timing.median_s * 1e3:.3f} ms, "
    f"reference {r.reference.timing.median_s * 1e3:.3f} ms, parity {worst:.2g}"
  )


def main(argv=None) -> int:
  cfg = parse_args(argv)
  target = backend.resolve()
  sizes = cfg.sizes or (("small",) if target.platform == "cpu" else ("large",))
  suites = cfg.suites or ALL_SUITES
  kernel_suites = tuple(s for s in suites if s not in (PEERS, ROLLOUT, MISMATCH, LOOP))
  cases = (
    [c for size in sizes for c in all_cases(size, target.platform, kernel_suites)]
    if kernel_suites
    else []
  )
  peaks = roofline.peaks_for(measure=cfg.measure_bandwidth)
  env = report.environment(peaks, target.platform, target.interpret)
  env["sizes"] = list(sizes)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = cfg.out or ROOT / "bench" / "results" / f"{device_slug(env['device_kind'])}-{stamp}"
  print(
    f"{len(cases)} kernel cases{' + the rollout suite' if ROLLOUT in suites else ''} at size "
    f"{'+'.join(sizes)} on {env['device_kind']} (jax {env['jax']}, kernel target {target.platform}"
    f"{', interpret mode' if target.interpret else ''})",
    flush=True,
  )
  results, rollout_runs, mismatch_runs = [], [], []
  from bench.cases import peers

  peer_rows = [(p, s) for size in sizes for p, s in peers.rows(size)] if PEERS in suites else []
  pending = [c.name for c in cases] + [peers.row_name(p, s) for p, s in peer_rows]
  pending += [f"rollout/{s}" for s in sizes if ROLLOUT in suites] + (
    ["loop"] if LOOP in suites else []
  )
  pending += [f"mismatch/{s}" for s in sizes if MISMATCH in suites and s in mismatch_bench.SIZES]

  def save(done: str | None = None, final: bool = False):
    # after every case and suite: a run killed by a time limit leaves a valid, partial report
    if done is not None:
      pending.remove(done)
    remaining = None if final else list(pending)
    report.write(out, env, results, rollout_runs, final and cfg.plots, mismatch_runs, remaining)

  limit = None if cfg.memory_limit_gib is None else int(cfg.memory_limit_gib * 2**30)
  save()
  with _profiling(cfg.profile, stamp) as profile_dir:
    quiet = not sys.stderr.isatty()  # a log file gets the per-case lines, not a progress bar
    for case in (bar := tqdm(cases, unit="case", file=sys.stderr, disable=quiet)):
      bar.set_description(case.name)
      t0 = time.perf_counter()
      r = run_case(
        case, peaks, seed=cfg.seed, warmup=cfg.warmup, repeats=cfg.repeats, memory_limit=limit
      )
      results.append(r)
      print(f"[case] {case_line(r)} ({time.perf_counter() - t0:.1f} s)", flush=True)
      save(case.name)
    for peer, shape in peer_rows:
      t0 = time.perf_counter()
      r = peers.run_peer(
        peer, shape, target.platform, seed=cfg.seed, warmup=cfg.warmup, repeats=cfg.repeats
      )
      release()
      results.append(r)
      print(f"[case] {case_line(r)} ({time.perf_counter() - t0:.1f} s)", flush=True)
      save(r.name)
    if ROLLOUT in suites:
      for size in sizes:
        print(f"rollout suite ({size}): paged vs dense generation ...", file=sys.stderr, flush=True)
        # the run's rows grow as they are measured; the report is rewritten after each one
        entry = dict(size=size, config=rollout_bench.SIZES[size], rows=[])
        rollout_runs.append(entry)

        def on_row(row, size=size, entry=entry):
          entry["rows"].append(row)
          print(
            f"[rollout] {size}/{row.workload}/{row.backend}: {row.tokens_per_s:.1f} tokens/s, "
            f"{'ok' if row.ok else 'PARITY FAILED'}",
            flush=True,
          )
          save()

        rows, extra = rollout_bench.run(size, cfg.rollout_repeats, on_row=on_row)
        entry.update(rows=rows, **extra)  # the table's order and the greedy agreement
        save(f"rollout/{size}")
    if LOOP in suites:
      print(f"loop suite: {loop_bench.DEFAULT_CONFIG}, GRPO steps ...", file=sys.stderr, flush=True)
      row, cmp = loop_bench.run(history=cfg.history)
      env["loop"] = {"row": row, "comparison": cmp}
      save("loop")
    if MISMATCH in suites:
      for size in (s for s in sizes if s in mismatch_bench.SIZES):
        print(f"mismatch suite ({size}): engines vs the trainer ...", file=sys.stderr, flush=True)
        rows = mismatch_bench.run(size)
        mismatch_runs.append(dict(size=size, config=mismatch_bench.SIZES[size], rows=rows))
        save(f"mismatch/{size}")
  if profile_dir:
    env["profile"] = str(profile_dir)
  save(final=True)  # complete: the partial marker goes
  print(report.markdown_table(results))
  for run in rollout_runs:
    print(f"\nrollout ({run['size']}):\n" + rollout_bench.markdown(run["rows"], run))
  for run in mismatch_runs:
    print(f"\nengine mismatch ({run['size']}):\n" + mismatch_bench.markdown(run["rows"]))
  print(f"\nwrote {out}/ (results.json, summary.md{', plots' if cfg.plots else ''})")
  if profile_dir:
    print(
      f"profile: python -m bench.trace {profile_dir}   |   nox -s tensorboard -- {profile_dir} "
      "(or tensorboard --logdir with the dev extra installed)"
    )
  failed = [r.name for r in results if not r.ok]
  failed += [
    f"rollout/{run['size']}/{r.workload}/{r.backend}"
    for run in rollout_runs
    for r in run["rows"]
    if not r.ok
  ]
  if LOOP in suites:
    print("\n" + loop_bench.describe(env["loop"]["row"], env["loop"]["comparison"]))
  if failed:
    print(f"FAILED (parity or error): {failed}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  raise SystemExit(main())
