"""The compiled report: every bench case compiled for a TPU generation on a host without one.

``python -m bench --target tpu-v6e`` (any generation or slice name: ``v5e``, ``v5litepod-8``, ``v4-8``)
runs each suite in a subprocess of this module (``python -m bench.tpu.compiled``) with libtpu's dump of
its scheduled code switched on (:func:`bench.tpu.schedule.dump_env`). Per case, on one abstract chip
of the slice, it compiles the kernel and its pure-JAX reference and records

* compile status (the compiler's reason when it fails: a Mosaic error, VMEM / HBM exhausted);
* ``memory_analysis()`` (HBM: arguments, outputs, temporaries) and each Mosaic kernel's VMEM
  allocations (from the dump) — *compiled*;
* XLA's cost model of both programs (``cost_analysis()``: bytes accessed against the case's ideal
  bytes, ``optimal_seconds``) — *compiled* (XLA's own model; it does not see inside Mosaic kernels);
* each Mosaic kernel's static schedule (bundles per grid step, spill loads / stores per step:
  :mod:`bench.tpu.schedule`) — *compiled*;
* a time per case — *modelled*: ``max(compute, memory, flops)``, compute = each kernel's bundles at
  the generation's clock (no stalls) times the times the program runs it, plus XLA's optimal time for
  the program's other ops (a loop body's matmuls added for every trip past the one XLA counts:
  :mod:`bench.tpu.hlo_loops`), memory = the case's ideal bytes at the datasheet HBM bandwidth (traffic a
  kernel adds above ideal is not modelled), flops = the case's flops at the bf16 peak. So a modelled
  time is never below the case's byte or flop floor. A figure XLA's cost model gives negative or
  not at all is shown as such and never used. Clock, bandwidth and peak per generation come from
  :mod:`kernels.tpu_targets`.

Nothing here is measured. On a TPU host, ``python -m bench --target <its generation>`` measures as
usual and puts these modelled figures beside the measured ones (:func:`merge_modelled`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from bench.tpu import hlo_loops
from bench.tpu import schedule as tpu_schedule

ROOT = pathlib.Path(__file__).resolve().parents[2]
LABEL = "compiled for {gen} on a host without a TPU: compiled or modelled figures, never measured"


def _reason(e: BaseException, limit: int = 400) -> str:
  """The compiler's reason, first line(s) that say it (XLA errors carry long stack traces)."""
  text = f"{type(e).__name__}: {e}"
  keep = [ln for ln in text.splitlines() if ln.strip() and "Source Location" not in ln][:3]
  out = " | ".join(keep)
  return out if len(out) <= limit else out[: limit - 3] + "..."


def _cost(compiled) -> dict:
  """XLA's cost model of a program (bytes accessed, flops, optimal seconds); {} when unavailable."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends do not implement it
    return {}
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  keys = {"bytes accessed": "bytes_accessed", "flops": "flops", "optimal_seconds": "optimal_s"}
  return {new: float(cost[old]) for old, new in keys.items() if old in cost}


def _schedules(dump: pathlib.Path, before: set[str], keep: pathlib.Path | None) -> list[dict]:
  """The Mosaic kernels dumped since ``before`` (their files moved out of the shared dump folder)."""
  new = [f for f in dump.iterdir() if f.name not in before]
  with tempfile.TemporaryDirectory(dir=dump.parent) as tmp:
    for f in new:
      shutil.move(str(f), tmp)
    rows = [dataclasses.asdict(k) for k in tpu_schedule.read_dump(tmp)]
    if keep is not None:
      keep.mkdir(parents=True, exist_ok=True)
      for f in pathlib.Path(tmp).glob("*final_bundles.txt"):
        shutil.copy(f, keep)
  return rows


def compile_side(fn, specs, donate, dump: pathlib.Path | None, keep=None) -> dict:
  """Compile one side of a case for the current target; its status, memory, cost and kernels."""
  import jax

  from bench.kernels import harness

  before = {f.name for f in dump.iterdir()} if dump else set()
  try:
    exe = jax.jit(fn, donate_argnums=donate).trace(*specs).lower().compile()
  except Exception as e:  # the row says why
    if dump:
      _schedules(dump, before, None)  # drop a failed compile's partial dump
    return {"status": "failed", "error": _reason(e)}
  row = {"status": "ok", "memory": dataclasses.asdict(harness.memory_of(exe)), "cost": _cost(exe)}
  row["loops"] = hlo_loops.read(exe.as_text()).as_dict()  # how often each kernel / loop body runs
  row["kernels"] = _schedules(dump, before, keep) if dump else []
  return row


def model(case: dict, kernel: dict, gen) -> dict:
  """The case's modelled time from its compiled kernel side (see the module docstring): never below
  the case's byte floor (``memory_s``) nor its flop floor (``flop_s``)."""
  memory_s = case["bytes"] / gen.hbm_bw if case.get("bytes") else None
  flop_s = case["flops"] / gen.bf16_flops if case.get("flops") else None
  out = {"memory_s": memory_s, "flop_s": flop_s, "compute_s": None, "modelled_s": None,
         "bound": None, "why": None, "lower_bound": False, "notes": []}  # fmt: skip
  if kernel.get("status") != "ok":
    out["why"] = "did not compile"
    return out
  compute = usable_seconds(kernel.get("cost", {}).get("optimal_s"), out["notes"])
  loops = kernel.get("loops")
  if loops is None:
    loops = {"kernels": {}, "uncounted_dot_flops": 0.0, "unknown": ["(HLO not read)"]}
  charged = set()
  for k in kernel.get("kernels", []):
    sched = tpu_schedule.KernelSchedule(**{f: k[f] for f in _SCHEDULE_FIELDS if f in k})
    t = sched.modelled_seconds(gen.clock_hz)
    if t is None:
      out["why"] = f"{k['name']}: schedule not readable ({'; '.join(k['problems'])})"
      return out
    program, runs = _runs(loops, k["name"])
    if program in charged:  # the same program dumped under a second name: its calls are counted
      continue
    charged.add(program)
    if runs is None:  # not found in the program's HLO: once, and the compute a lower bound
      out["notes"].append(f"{k['name']}: runs per program not read, counted once")
      out["lower_bound"], runs = True, 1
    compute += runs * t
    # a loop whose trip count is not a literal (a length-bounded loop) counted once per step
    out["lower_bound"] |= bool(k.get("unknown_trips"))
  compute += loops.get("uncounted_dot_flops", 0.0) / gen.bf16_flops  # loop bodies' matmuls
  for name, runs in loops.get("fallback", {}).items():
    out["notes"].append(f"{name}: a conditional's fallback, not charged (best case; {runs} if run)")
  if loops.get("unknown"):
    out["lower_bound"] = True
    out["notes"].append(f"loops of unread trip count counted once: {', '.join(loops['unknown'])}")
  out["compute_s"] = compute
  floors = {
    "compute (schedule)": compute,
    "memory": memory_s or 0.0,
    "flops at peak": flop_s or 0.0,
  }
  out["bound"] = max(floors, key=lambda b: floors[b])  # ties: the schedule, then memory
  out["modelled_s"] = floors[out["bound"]]
  if out["lower_bound"]:
    out["bound"] += "; compute a lower bound: loops of unknown trip counted once"
  return out


def _runs(loops: dict, name: str) -> tuple[str, int | None]:
  """(program, runs) of the dumped kernel ``name``: the runs of every call whose kernel is the same
  program (libtpu compiles and dumps it once, under one call's name); runs None where the HLO has no
  such call."""
  same = loops.get("same_program", {})
  program = same.get(name, name)
  if name not in loops["kernels"]:
    return program, None
  return program, sum(r for call, r in loops["kernels"].items() if same.get(call, call) == program)


def usable_seconds(value, notes: list) -> float:
  """XLA's optimal time where it is a time (finite, >= 0); else 0 and a note saying what it was."""
  if value is None:
    notes.append("XLA's optimal time: none given, not used")
    return 0.0
  if not math.isfinite(value) or value < 0:
    notes.append(f"XLA's optimal time {value * 1e3:.3f} ms (not a time): not used")
    return 0.0
  return float(value)


_SCHEDULE_FIELDS = [f.name for f in dataclasses.fields(tpu_schedule.KernelSchedule)]


def compile_case(case, slice_name: str, dump: pathlib.Path | None, keep=None) -> dict:
  """One case's compiled row, in results.json's case form (kernel / reference timings None)."""
  why = case.unavailable() if case.unavailable else None
  if why:  # a peer that cannot be installed here: a skipped row (ok), not a failure
    return dict(name=case.name, op=case.op, shape=case.shape_name, mode=case.mode,
                params=case.params, bytes=case.bytes, flops=case.flops, kernel=None,
                reference=None, parity={}, speedup=None, ok=True, error=None, skipped=why)  # fmt: skip
  import jax

  from kernels import backend, tpu_targets

  gen = tpu_targets.Slice.parse(slice_name).generation
  sharding = jax.sharding.SingleDeviceSharding(backend.tpu_devices(slice_name)[0])
  abstract = jax.eval_shape(lambda: case.make_inputs(0))
  specs = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract
  )
  row = dict(
    name=case.name, op=case.op, shape=case.shape_name, mode=case.mode, params=case.params,
    bytes=case.bytes, flops=case.flops, kernel=None, reference=None, parity={}, speedup=None,
    error=None, skipped=None,
  )  # fmt: skip
  with backend.use_target("tpu", interpret=False, generation=gen.name):
    sides = {
      side: compile_side(fn, specs, case.donate_argnums, dump, keep and keep / side)
      for side, fn in (("kernel", case.kernel), ("reference", case.reference))
    }
  row["ok"] = sides["kernel"]["status"] == "ok"
  if not row["ok"]:
    row["error"] = sides["kernel"]["error"]
  row["compiled"] = dict(
    generation=gen.name, target=slice_name, clock_hz=gen.clock_hz, hbm_bytes_per_s=gen.hbm_bw,
    **sides, model=model(row, sides["kernel"], gen),
  )  # fmt: skip
  return row


# ---------------------------------------------------------------------------- the suite subprocess
def _suite_main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m bench.tpu.compiled", description=__doc__.split("\n")[0]
  )
  p.add_argument("--target", required=True, help="TPU generation or slice, e.g. v6e, v5litepod-8")
  p.add_argument("--suite", required=True)
  p.add_argument("--size", default="large")
  p.add_argument("--out", type=pathlib.Path, required=True, help="JSON lines, one row per case")
  p.add_argument("--dump", type=pathlib.Path, help="libtpu's dump folder (LIBTPU_INIT_ARGS)")
  p.add_argument("--keep-bundles", type=pathlib.Path, help="keep each kernel's final bundles here")
  a = p.parse_args(argv)
  from bench.kernels.cases import all_cases

  for case in all_cases(a.size, "tpu", (a.suite,)):
    keep = a.keep_bundles / case.name.replace("/", "_") if a.keep_bundles else None
    try:
      row = compile_case(case, a.target, a.dump, keep)
    except Exception as e:  # a case that cannot even be set up is a failed row
      row = dict(name=case.name, op=case.op, shape=case.shape_name, mode=case.mode,
                 params=case.params, bytes=case.bytes, flops=case.flops, kernel=None,
                 reference=None, parity={}, speedup=None, ok=False, error=_reason(e),
                 skipped=None)  # fmt: skip
    with a.out.open("a") as f:
      f.write(json.dumps(row, default=float) + "\n")
    print(f"[compiled] {describe_row(row)}", flush=True)
  return 0


def run_suite(target: str, suite: str, size: str, timeout_s: float = 1800.0) -> list[dict]:
  """One suite's rows from a subprocess whose libtpu dumps its schedule (rows so far on a crash)."""
  with tempfile.TemporaryDirectory(prefix="tpu-compiled-") as tmp:
    out, dump = pathlib.Path(tmp) / "rows.jsonl", pathlib.Path(tmp) / "dump"
    dump.mkdir()
    cmd = [sys.executable, "-m", "bench.tpu.compiled", "--target", target, "--suite", suite,
           "--size", size, "--out", str(out), "--dump", str(dump)]  # fmt: skip
    env = tpu_schedule.dump_env(dump)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
      proc = subprocess.run(
        cmd, env=env, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True
      )
      failure = None if proc.returncode == 0 else (proc.stderr or "").strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
      failure = [f"suite {suite} timed out after {timeout_s:.0f} s"]
    rows = [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []
  if failure:
    print(f"[compiled] suite {suite} subprocess: {' | '.join(failure)}", file=sys.stderr)
    if not rows:
      rows = [dict(name=f"{suite}/(suite)", op=suite, shape="-", mode="-", params={}, bytes=None,
                   flops=None, kernel=None, reference=None, parity={}, speedup=None, ok=False,
                   error=" | ".join(failure), skipped=None)]  # fmt: skip
  return rows


def describe_row(row: dict) -> str:
  c = row.get("compiled")
  if row.get("skipped"):
    return f"{row['name']}: skipped ({row['skipped']})"
  if not c:
    return f"{row['name']}: FAILED {row.get('error')}"
  m, k = c["model"], c["kernel"]
  if k["status"] != "ok":
    return f"{row['name']}: kernel did not compile: {k['error']}"
  t = m.get("modelled_s")
  return (
    f"{row['name']}: modelled {t * 1e3:.3f} ms ({m['bound']})"
    if t
    else f"{row['name']}: {m['why']}"
  )


def environment(slice_name: str) -> dict:
  """results.json's environment for a compiled report (the generation compiled for, not the host)."""
  import datetime

  import jax

  from bench.provenance import git_commit
  from kernels import tpu_targets

  gen = tpu_targets.Slice.parse(slice_name).generation
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "measurement": "compiled",
    "target": slice_name,
    "device_kind": gen.device_kind,
    "device_platform": "tpu",
    "device_count": 1,
    "kernel_target": "tpu",
    "interpret_mode": False,
    "jax": jax.__version__,
    "libtpu": tpu_targets.libtpu_version(),
    "git_commit": git_commit(),
    "clock_hz": gen.clock_hz,
    "peaks": {
      "hbm_bytes_per_s": gen.hbm_bw,
      "bf16_flops_per_s": gen.bf16_flops,
      "source": "datasheet (kernels.tpu_targets), not measured",
    },
    "label": LABEL.format(gen=gen.name),
  }


def merge_modelled(measured: list, compiled: list[dict]) -> list[dict]:
  """On a TPU: each measured row (as a dict) with its case's compiled / modelled figures beside it."""
  from bench.report import as_dict

  by_name = {r["name"]: r.get("compiled") for r in compiled}
  return [dict(as_dict(r), compiled=by_name.get(as_dict(r)["name"])) for r in measured]


# ------------------------------------------------------------- the compile-checked tuner (TPU)
def evaluate_modelled(slice_name: str, dump: pathlib.Path):
  """``bench.kernels.autotune_search.tune``'s ``evaluate`` for a TPU generation on a host without it: every
  candidate compiled (nothing runs: parity is not checked here, only the interpreter tests check
  the kernels), those that fail dropped with the compiler's reason, the rest ranked by modelled time
  (:func:`model`). The heuristic row is compiled and modelled too, as the baseline."""
  import jax

  from bench.kernels.autotune_search import Candidate
  from kernels import autotune, backend, tpu_targets

  gen = tpu_targets.Slice.parse(slice_name).generation
  sharding = jax.sharding.SingleDeviceSharding(backend.tpu_devices(slice_name)[0])

  def evaluate(problem, candidates, deadline, log):
    abstract = jax.eval_shape(problem.make_inputs)
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    specs = jax.tree.map(spec, abstract)
    todo = [Candidate(autotune.HEURISTIC, None, problem.heuristic)] if problem.heuristic else []
    rows = []
    with backend.use_target("tpu", interpret=False, generation=gen.name):
      for cand in [*todo, *candidates]:
        side = compile_side(cand.fn, specs, (), dump)
        m = model({"bytes": problem.ideal_bytes}, side, gen)
        row = dict(impl=cand.impl, blocks=autotune.blocks_to_json(cand.blocks), label=cand.label)
        row.update(ok=m["modelled_s"] is not None, time_s=m["modelled_s"], parity_error=None,
                   source="modelled", bound=m["bound"])  # fmt: skip
        if side["status"] != "ok" or m["modelled_s"] is None:
          row["error"] = side.get("error") or m["why"]
        rows.append(row)
        t = "-" if row["time_s"] is None else f"{row['time_s'] * 1e3:.3f} ms modelled"
        log(f"  {problem.op} {cand.label}: {t}{' ' + row['error'] if row.get('error') else ''}")
    passing = [r for r in rows if r["ok"] and r["impl"] != autotune.HEURISTIC]
    winner = min(passing, key=lambda r: r["time_s"]) if passing else None
    entry = dict(
      shape=problem.shape,
      winner=None if winner is None else dict(impl=winner["impl"], blocks=winner["blocks"]),
      candidates=[r for r in rows if r["impl"] != autotune.HEURISTIC],
    )
    base = next((r for r in rows if r["impl"] == autotune.HEURISTIC), None)
    if base is not None:
      entry["heuristic"] = base
    return entry

  return gen, evaluate


def tune_in_process(slice_name, size, out, ops, run_modelled_op):
  """The op subprocess of :func:`tune_modelled`: its libtpu dumps to $BENCH_TPU_DUMP."""
  gen, evaluate = evaluate_modelled(slice_name, pathlib.Path(os.environ["BENCH_TPU_DUMP"]))
  log = lambda line: print(line, flush=True)
  return run_modelled_op(size, out, ops, log=log, platform="tpu", kind=gen.device_kind,
                         evaluate=evaluate, source="modelled")  # fmt: skip


def tune_modelled(target: str, size: str, out, ops, timeout_s: float = 3600.0):
  """``python -m bench.tune --target``: one subprocess per op (libtpu's dump flag is per process);
  returns the cache file of the generation's device kind."""
  from kernels import autotune, tpu_targets

  name = target[4:] if target.lower().startswith("tpu-") else target
  gen = tpu_targets.Slice.parse(name).generation
  for op in dict.fromkeys(ops):
    with tempfile.TemporaryDirectory(prefix="tpu-tune-") as dump:
      env = tpu_schedule.dump_env(dump)
      env["BENCH_TPU_DUMP"] = dump
      env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
      cmd = [sys.executable, "-m", "bench.tune", "--target", name, "--in-process", "--op", op,
             "--size", size] + (["--out", str(out)] if out else [])  # fmt: skip
      print(f"[tune] {op}: compiling candidates for {name}", flush=True)
      subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout_s, check=False)
  return autotune.cache_path(gen.device_kind, out)


if __name__ == "__main__":
  raise SystemExit(_suite_main())
