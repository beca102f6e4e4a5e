"""``python -m bench`` (what ``nox -s bench`` runs): every suite, kernel vs reference, one report.

Examples::

    python -m bench                                  # this backend's default size, every suite
    python -m bench --suite grpo_loss --size large   # real shapes (for a GPU / TPU)
    python -m bench --size small --size large        # both: time-vs-size curves over more shapes
    python -m bench --profile                        # also a jax.profiler trace in profiles/bench-<time>/
    python -m bench --suite optim --case 'optim/adamw-*'  # only the kernel cases whose name matches

Writes ``bench/results/<device kind>-<time>/`` (e.g. ``cpu-20261123-101500``): results.json, summary.md, roofline.png,
time_vs_size.png and rollout.png. The ``mismatch`` suite adds each rollout engine's log-prob mismatch
against the trainer (bench/mismatch.py). ``--suite tunix`` (asked for by name; needs google-tunix)
compiles tunix's GRPO step with its loss and ours (bench/loop/tunix_memory.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import pathlib
import re
import sys
import time

from tqdm import tqdm

from bench import mismatch as mismatch_bench
from bench import report
from bench.cli import (
  ALL_SUITES,
  LOOP,
  MISMATCH,
  PEERS,
  ROLLOUT,
  TUNIX,
  BenchConfig,
  chosen,
  parse_args,
  tpu_slice,
)
from bench.kernels import roofline
from bench.kernels.cases import SUITES, all_cases
from bench.kernels.run import release, run_case
from bench.loop import step_time as loop_bench
from bench.rollout import table as rollout_table
from bench.rollout import throughput as rollout_bench
from kernels import backend

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


@dataclasses.dataclass
class Run:
  """One bench run's state: what is planned, what finished, where the report goes."""

  cfg: BenchConfig
  env: dict
  peaks: roofline.DevicePeaks
  stamp: str
  out: pathlib.Path
  sizes: tuple[str, ...]
  suites: tuple[str, ...]
  cases: list
  pending: list[str]
  results: list = dataclasses.field(default_factory=list)
  rollout_runs: list = dataclasses.field(default_factory=list)
  mismatch_runs: list = dataclasses.field(default_factory=list)

  def save(self, done: str | None = None, final: bool = False):
    """After every case and suite: a run killed by a time limit leaves a valid, partial report."""
    if done is not None:
      self.pending.remove(done)
    remaining = None if final else list(self.pending)
    report.write(
      self.out, self.env, self.results, self.rollout_runs, final and self.cfg.plots,
      self.mismatch_runs, remaining,
    )  # fmt: skip


def _stamp() -> str:
  return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def _plan(cfg: BenchConfig) -> Run:
  target = backend.resolve()
  sizes = cfg.sizes or (("small",) if target.platform == "cpu" else ("large",))
  suites = cfg.suites or ALL_SUITES
  kernel_suites = tuple(s for s in suites if s not in (PEERS, ROLLOUT, MISMATCH, LOOP))
  cases = []
  if kernel_suites:  # all_cases reads none as every kernel suite: `--suite rollout` times no kernel
    cases = [c for size in sizes for c in all_cases(size, target.platform, kernel_suites)]
  cases = chosen(cases, cfg.cases)
  peaks = roofline.peaks_for(measure=cfg.measure_bandwidth)
  env = report.environment(peaks, target.platform, target.interpret)
  env["sizes"] = list(sizes)
  stamp = _stamp()
  out = cfg.out or ROOT / "bench" / "results" / f"{device_slug(env['device_kind'])}-{stamp}"
  from bench.kernels.cases import peers

  pending = [c.name for c in cases]
  pending += [peers.row_name(p, s) for size in sizes for p, s in peers.rows(size)] if PEERS in suites else []  # fmt: skip
  pending += [f"rollout/{s}" for s in sizes if ROLLOUT in suites] + (
    ["loop"] if LOOP in suites else []
  )
  pending += [f"mismatch/{s}" for s in sizes if MISMATCH in suites and s in mismatch_bench.SIZES]
  print(
    f"{len(cases)} kernel cases{' + the rollout suite' if ROLLOUT in suites else ''} at size "
    f"{'+'.join(sizes)} on {env['device_kind']} (jax {env['jax']}, kernel target {target.platform}"
    f"{', interpret mode' if target.interpret else ''})",
    flush=True,
  )
  return Run(cfg, env, peaks, stamp, out, sizes, suites, cases, pending)


def _kernel_cases(run: Run) -> None:
  cfg = run.cfg
  limit = None if cfg.memory_limit_gib is None else int(cfg.memory_limit_gib * 2**30)
  peaks = run.peaks
  quiet = not sys.stderr.isatty()  # a log file gets the per-case lines, not a progress bar
  for case in (bar := tqdm(run.cases, unit="case", file=sys.stderr, disable=quiet)):
    bar.set_description(case.name)
    t0 = time.perf_counter()
    r = run_case(
      case, peaks, seed=cfg.seed, warmup=cfg.warmup, repeats=cfg.repeats, memory_limit=limit
    )
    run.results.append(r)
    print(f"[case] {case_line(r)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    run.save(case.name)


def _peer_cases(run: Run) -> None:
  from bench.kernels.cases import peers

  platform = backend.resolve().platform
  for peer, shape in [(p, s) for size in run.sizes for p, s in peers.rows(size)]:
    t0 = time.perf_counter()
    r = peers.run_peer(peer, shape, platform, seed=run.cfg.seed, warmup=run.cfg.warmup,
                       repeats=run.cfg.repeats)  # fmt: skip
    release()
    run.results.append(r)
    print(f"[case] {case_line(r)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    run.save(r.name)


def _rollout_suite(run: Run) -> None:
  for size in run.sizes:
    print(f"rollout suite ({size}): paged vs dense generation ...", file=sys.stderr, flush=True)
    # the run's rows grow as they are measured; the report is rewritten after each one
    entry = dict(size=size, config=rollout_bench.SIZES[size], rows=[])
    run.rollout_runs.append(entry)

    def on_row(row, size=size, entry=entry):
      entry["rows"].append(row)
      print(
        f"[rollout] {size}/{row.workload}/{row.backend}: {row.tokens_per_s:.1f} tokens/s, "
        f"{'ok' if row.ok else 'PARITY FAILED'}",
        flush=True,
      )
      run.save()

    rows, extra = rollout_bench.run(size, run.cfg.rollout_repeats, on_row=on_row)
    entry.update(rows=rows, **extra)  # the table's order and the greedy agreement
    run.save(f"rollout/{size}")


def _loop_suite(run: Run) -> None:
  print(f"loop suite: {loop_bench.DEFAULT_CONFIG}, GRPO steps ...", file=sys.stderr, flush=True)
  row, cmp = loop_bench.run(history=run.cfg.history)
  run.env["loop"] = {"row": row, "comparison": cmp}
  run.save("loop")


def _mismatch_suite(run: Run) -> None:
  for size in (s for s in run.sizes if s in mismatch_bench.SIZES):
    print(f"mismatch suite ({size}): engines vs the trainer ...", file=sys.stderr, flush=True)
    rows = mismatch_bench.run(size)
    run.mismatch_runs.append(dict(size=size, config=mismatch_bench.SIZES[size], rows=rows))
    run.save(f"mismatch/{size}")


def _finish(run: Run, profile_dir) -> int:
  """The final (complete) report, the tables on stdout, the exit status (1: a parity failure)."""
  if profile_dir:
    run.env["profile"] = str(profile_dir)
  if run.cfg.target and run.results:  # on the TPU itself: the modelled times beside the measured
    from bench.tpu import compiled

    rows = [r for s in _kernel_suites(run) for r in compiled.run_suite(tpu_slice(run.cfg.target), s, run.sizes[0])]  # fmt: skip
    run.results = compiled.merge_modelled(run.results, rows)
  run.save(final=True)  # complete: the partial marker goes
  print(report.markdown_table(run.results))
  for r in run.rollout_runs:
    print(f"\nrollout ({r['size']}):\n" + rollout_table.markdown(r["rows"], r))
  for r in run.mismatch_runs:
    print(f"\nengine mismatch ({r['size']}):\n" + mismatch_bench.markdown(r["rows"]))
  print(f"\nwrote {run.out}/ (results.json, summary.md{', plots' if run.cfg.plots else ''})")
  if profile_dir:
    print(
      f"profile: python -m bench.trace {profile_dir}   |   nox -s tensorboard -- {profile_dir} "
      "(or tensorboard --logdir with the dev extra installed)"
    )
  failed = [report.as_dict(r)["name"] for r in run.results if not report.as_dict(r)["ok"]]
  failed += [f"rollout/{x['size']}/{r.workload}/{r.backend}" for x in run.rollout_runs
             for r in x["rows"] if not r.ok]  # fmt: skip
  if LOOP in run.suites:
    print("\n" + loop_bench.describe(run.env["loop"]["row"], run.env["loop"]["comparison"]))
  if failed:
    print(f"FAILED (parity or error): {failed}", file=sys.stderr)
  return 1 if failed else 0


def _kernel_suites(run_or_cfg) -> tuple[str, ...]:
  suites = run_or_cfg.suites if isinstance(run_or_cfg, Run) else (run_or_cfg.suites or ALL_SUITES)
  return tuple(s for s in suites if s in SUITES and s != "mosaic_gpu")


def compiled_main(cfg: BenchConfig) -> int:
  """--target without that TPU here: every kernel suite compiled for it, one subprocess per suite
  (libtpu's schedule dump is switched on per process), the report labelled compiled / modelled."""
  from bench.tpu import compiled

  name = tpu_slice(cfg.target)
  sizes = cfg.sizes or ("large",)
  env = compiled.environment(name)
  env["sizes"] = list(sizes)
  stamp = _stamp()
  out = (
    cfg.out or ROOT / "bench" / "results" / f"{device_slug(env['device_kind'])}-compiled-{stamp}"
  )
  print(f"compiling every case for {name} ({env['label']})", flush=True)
  rows, todo = [], [(s, z) for z in sizes for s in _kernel_suites(cfg)]
  for i, (suite, size) in enumerate(todo):
    new = compiled.run_suite(name, suite, size)
    rows += new
    print("\n".join(f"[compiled] {compiled.describe_row(r)}" for r in new), flush=True)
    report.write(out, env, rows, plots=False, remaining=[f"{s}/{z}" for s, z in todo[i + 1 :]])
  report.write(out, env, rows, plots=cfg.plots)
  print(report.compiled_table(rows))
  print(f"\nwrote {out}/ (results.json, summary.md{', plots' if cfg.plots else ''})")
  return 0 if all(r["ok"] for r in rows) else 1


def main(argv=None) -> int:
  cfg = parse_args(argv)
  if cfg.suites and TUNIX in cfg.suites:
    from bench.loop import tunix_memory

    rc = tunix_memory.bench_suite(
      cfg.out or ROOT / "bench" / "results" / f"tunix-memory-{_stamp()}"
    )
    rest = tuple(s for s in cfg.suites if s != TUNIX)
    if not rest:
      return rc
    cfg = dataclasses.replace(cfg, suites=rest)
  if cfg.target and backend.host_platform() != "tpu":
    return compiled_main(cfg)
  try:
    run = _plan(cfg)
  except ValueError as e:  # a --case glob that matches nothing: named before anything compiles
    print(f"python -m bench: error: {e}", file=sys.stderr)
    return 2
  run.save()
  with _profiling(cfg.profile, run.stamp) as profile_dir:
    _kernel_cases(run)
    if PEERS in run.suites:
      _peer_cases(run)
    if ROLLOUT in run.suites:
      _rollout_suite(run)
    if LOOP in run.suites:
      _loop_suite(run)
    if MISMATCH in run.suites:
      _mismatch_suite(run)
  return _finish(run, profile_dir)


if __name__ == "__main__":
  raise SystemExit(main())
