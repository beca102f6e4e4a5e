"""``python -m bench.device --call CALL``: what a lent accelerator should measure, as independent calls.

GPU time comes in commands of at most 10 minutes whose output comes back as a few files (at most 8,
two folders deep). So the plan is three calls, each ≤ 9 minutes on one H100, each run as its own
command, each leaving in ``--out`` exactly three files: ``<call>-<device>.tar.gz`` (every step's log
and results), ``<call>.json`` (per step: command, limit, return code, wall time) and ``summary.md``,
which is also printed last:

  kernels  the gpu-marked tests; every kernel suite at --size large, one subprocess per suite
           (grpo_loss, paged_attention, mosaic_gpu, fused_linear, optim); the peers (bench/kernels/cases/peers.py)
  tune     the autotuner, one subprocess per op, each with a time budget; its cache is installed
           into kernels/tuning/ (and is in the archive)
  loop     the rollout suite; a 2-seed xla vs pallas ``bench.parity`` on configs/gpu-qwen2.5-0.5b.yaml
           (step_avg); a profile of two loop steps (their rollout decode chunks included) and
           ``bench.trace``'s summary of it

Every step is a subprocess with a wall-clock limit taken from the first H100 run's measured durations
(below); it prints a line per case as it finishes (echoed here, so a killed step shows where it was)
and rewrites its results after every case, so a step stopped by its limit keeps its rows. The archive
is rewritten after every step. Within a call every step shares one persistent compilation cache, set
through ``jax.config`` by the step launcher (``python -m bench.device exec``), so the loop's arms and
seeds share compiled executables.

    PYTHONPATH=. python -m bench.device --call kernels --out $OUT     # on the GPU
    PYTHONPATH=. python -m bench.device --call loop --data DIR --dry-run
    PYTHONPATH=. python -m bench.device --call tune --size tiny        # the whole path on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

from bench.device.plan import CALL_BUDGET_S, CALLS, Step, plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
ECHO_SKIP = ("\r",)  # progress bars: the log keeps them, the console does not
BIG_FILE = 8 << 20  # files above this stay out of the archive (listed in <call>.json)
ARCHIVE_RAW_BUDGET = (
  40 << 20
)  # bytes before compression: the archive stays under a returned file's 16 MiB
SKIP_PARTS = ("jax-cache", "checkpoints")  # re-creatable, and large: never archived
SKIP_SUFFIXES = (
  ".hlo_proto.pb",
)  # the trace's HLO dumps (the xplane keeps what TensorBoard needs)


@dataclasses.dataclass
class StepResult:
  name: str
  argv: list[str]
  limit_s: float
  returncode: int | None
  wall_s: float
  timed_out: bool
  skipped: str | None
  log: str
  results: str | None = None  # the step's results, relative to the work dir


# ----------------------------------------------------------------------------------- the launcher
def exec_main(argv: list[str]) -> None:
  """``python -m bench.device exec [--compilation-cache DIR] [--memory-fraction F] -- -m MODULE ...``:
  set the call's jax options through ``jax.config`` before any backend exists, then run MODULE as
  ``__main__``. The compilation cache is what lets a call's steps share compiled executables; the
  memory fraction keeps jax from preallocating the memory torch needs when both share the GPU."""
  import runpy

  p = argparse.ArgumentParser(prog="python -m bench.device exec")
  p.add_argument("--compilation-cache", type=pathlib.Path)
  p.add_argument("--memory-fraction", type=float)
  p.add_argument("module_argv", nargs=argparse.REMAINDER)
  a = p.parse_args(argv)
  rest = a.module_argv[1:] if a.module_argv[:1] == ["--"] else a.module_argv
  if len(rest) < 2 or rest[0] != "-m":
    p.error("expected -- -m MODULE [ARGS...]")
  import jax

  if a.compilation_cache is not None:
    jax.config.update("jax_compilation_cache_dir", str(a.compilation_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if a.memory_fraction is not None:
    if not 0 < a.memory_fraction <= 1:
      p.error(f"--memory-fraction must be in (0, 1], got {a.memory_fraction}")
    opts = {"preallocate": False, "memory_fraction": a.memory_fraction}
    jax.config.update("jax_pjrt_client_create_options", opts)  # read when the GPU client is made
  sys.argv = [rest[1], *rest[2:]]
  runpy.run_module(rest[1], run_name="__main__", alter_sys=True)


# ------------------------------------------------------------------------------------ running steps
def _echo(stream, log, prefix: str):
  for line in iter(stream.readline, ""):
    log.write(line)
    log.flush()
    if not any(c in line for c in ECHO_SKIP):
      print(f"{prefix}{line}", end="", flush=True)


def run_step(step: Step, work: pathlib.Path, cache: pathlib.Path | None) -> StepResult:
  """Run ``step`` under its limit, its output in ``work/logs/<name>.log`` and echoed line by line.
  At the limit the whole process group is killed; what the step wrote before stays."""
  logs = work / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  log = logs / f"{step.name}.log"
  base = dict(name=step.name, argv=step.argv, limit_s=step.limit_s, log=str(log.relative_to(work)))
  base["results"] = step.results
  if step.skip_reason:
    log.write_text(f"skipped: {step.skip_reason}\n")
    return StepResult(
      **base, returncode=None, wall_s=0.0, timed_out=False, skipped=step.skip_reason
    )
  argv = step.argv
  if step.jax:  # a python module run through the launcher, with the call's jax options
    launcher = [sys.executable, "-m", "bench.device", "exec"]
    if cache is not None:
      launcher += ["--compilation-cache", str(cache)]
    if step.memory_fraction is not None:
      launcher += ["--memory-fraction", str(step.memory_fraction)]
    argv = [*launcher, "--", "-m", *step.argv]
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  t0 = time.perf_counter()
  with log.open("w") as f:
    f.write(" ".join(argv) + "\n\n")
    f.flush()
    proc = subprocess.Popen(
      argv,
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      errors="replace",  # a stray non-UTF-8 byte must not stop the echo
      start_new_session=True,  # its own process group: the limit kills its children too
    )
    reader = threading.Thread(target=_echo, args=(proc.stdout, f, f"  [{step.name}] "))
    reader.start()
    try:
      rc, timed_out = proc.wait(timeout=step.limit_s), False
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, nothing else
      proc.wait()
      rc, timed_out = None, True
    reader.join(timeout=10)
  wall = time.perf_counter() - t0
  return StepResult(**base, returncode=rc, wall_s=wall, timed_out=timed_out, skipped=None)


# ----------------------------------------------------------------------------------- the call's files
def write_archive(work: pathlib.Path, path: pathlib.Path) -> list[str]:
  """Everything under ``work`` worth returning as one tar.gz (written to a temporary name, then
  renamed): no compilation cache, checkpoints or HLO dumps, no file over BIG_FILE, and small files
  first up to ARCHIVE_RAW_BUDGET. Returns what was left out, with why."""
  left_out, total = [], 0
  files = [f for f in work.rglob("*") if f.is_file()]
  tmp = path.with_name(f".{path.name}.tmp")
  with tarfile.open(tmp, "w:gz") as tar:
    for f in sorted(files, key=lambda f: (f.stat().st_size, str(f))):
      rel, size = f.relative_to(work), f.stat().st_size
      if set(rel.parts) & set(SKIP_PARTS) or f.name.endswith(SKIP_SUFFIXES):
        continue
      if size > BIG_FILE or total + size > ARCHIVE_RAW_BUDGET:
        left_out.append(f"{rel} ({size / 2**20:.1f} MiB)")
        continue
      total += size
      tar.add(f, arcname=str(pathlib.Path(path.name.split(".")[0]) / rel))
  tmp.replace(path)
  return left_out


def step_status(r: StepResult) -> str:
  if r.skipped:
    return f"skipped: {r.skipped}"
  if r.timed_out:
    return "STOPPED at its limit"
  return "ok" if r.returncode == 0 else f"FAILED (rc {r.returncode})"


def summary(results: list[StepResult], meta: dict, work: pathlib.Path | None = None) -> str:
  """The call's table (a row per step: status, wall, limit, what it kept), then each step's own
  figures read from its results (bench rows, tune winners, parity, trace summary)."""
  from bench.device import summary as device_summary

  lines = [
    f"# bench.device --call {meta.get('call')}: {meta.get('device')} — jax {meta.get('jax')} — "
    f"{meta['date']} — {meta['commit']}",
    "",
    "| step | status | wall (s) | limit (s) | kept | log |",
    "|---|---|---|---|---|---|",
  ]
  details = []
  for r in results:
    kept, detail = device_summary.describe(r, work) if work else ("-", "")
    lines.append(
      f"| {r.name} | {step_status(r)} | {r.wall_s:.1f} | {r.limit_s:.0f} | {kept} | "
      f"{pathlib.Path(r.log).name} |"
    )
    if detail:
      details.append(f"\n## {r.name}\n\n{detail}")
  return "\n".join(lines + details) + "\n"


def _commit() -> str | None:
  try:
    return subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
  except OSError:
    return None


def install_cache(work: pathlib.Path) -> list[str]:
  """Copy the tuned caches into kernels/tuning/ (committed: impl="auto" reads them)."""
  from kernels import autotune

  copied = []
  for path in sorted((work / "tuning").glob("*.json")):
    autotune.TUNING_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, autotune.TUNING_DIR / path.name)
    copied.append(str(autotune.TUNING_DIR / path.name))
  return copied


def run_call(
  call: str, steps: list[Step], out: pathlib.Path, work: pathlib.Path, meta: dict
) -> int:
  """Run ``steps`` in order; after each, rewrite the archive, ``<call>.json`` and summary.md in
  ``out`` (so even a call killed from outside leaves the steps it finished). Prints the summary last."""
  out.mkdir(parents=True, exist_ok=True)
  work.mkdir(parents=True, exist_ok=True)
  cache = work / "jax-cache"
  archive = out / f"{call}-{meta['slug']}.tar.gz"
  results: list[StepResult] = []
  text = ""
  for s in steps:
    print(f"[device] {s.name} (limit {s.limit_s:.0f} s) ...", flush=True)
    r = run_step(s, work, cache)
    results.append(r)
    print(f"[device] {s.name}: {step_status(r)} in {r.wall_s:.1f} s", flush=True)
    meta["left_out_of_archive"] = write_archive(work, archive)
    payload = dict(meta, steps=[dataclasses.asdict(x) for x in results])
    (out / f"{call}.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = summary(results, meta, work)
    (out / "summary.md").write_text(text)
  print("\n" + text, flush=True)
  failed = [r.name for r in results if not r.skipped and r.returncode != 0]
  return 1 if failed else 0


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["exec"]:
    exec_main(argv[1:])
    return 0
  p = argparse.ArgumentParser(prog="python -m bench.device", description=__doc__.split("\n")[0])
  p.add_argument("--call", required=True, choices=CALLS)
  p.add_argument("--size", default="large", choices=("tiny", "large"))
  p.add_argument("--out", type=pathlib.Path, help="the call's 3 files (default bench/results/...)")
  p.add_argument("--work", type=pathlib.Path, help="steps' files before archiving (default: temp)")
  p.add_argument("--step", action="append", help="run only these steps (repeatable)")
  p.add_argument("--limit", action="append", default=[], metavar="STEP=S", help="override a limit")
  p.add_argument("--data", type=pathlib.Path, help="GSM8K dir for the loop call")
  p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
  p.add_argument("--no-install-cache", action="store_true", help="leave kernels/tuning/ untouched")
  a = p.parse_args(argv)
  import jax  # after argparse: --help needs no backend

  kind = jax.devices()[0].device_kind
  slug = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
  out = (a.out or ROOT / "bench" / "results" / f"device-{a.call}-{slug}-{stamp}").resolve()
  work = (a.work or pathlib.Path(tempfile.mkdtemp(prefix=f"bench-device-{a.call}-"))).resolve()
  try:
    limits = {k: float(v) for k, v in (x.split("=", 1) for x in a.limit)}
    steps = plan(a.call, a.size, work, a.data, limits, only=a.step)
  except ValueError as e:
    p.error(str(e))
  if a.dry_run:
    for s in steps:
      note = f"  [skip: {s.skip_reason}]" if s.skip_reason else ""
      print(f"{s.name:16s} (<= {s.limit_s:.0f}s): {' '.join(s.argv)}{note}")
    print(f"total limit {sum(s.limit_s for s in steps):.0f} s (call budget {CALL_BUDGET_S} s)")
    return 0
  meta = dict(
    call=a.call,
    device=kind,
    slug=slug,
    jax=jax.__version__,
    size=a.size,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    commit=_commit(),
  )
  rc = run_call(a.call, steps, out, work, meta)
  if a.call == "tune" and a.size != "tiny" and not a.no_install_cache:
    print(f"[device] installed {install_cache(work)}")
  if a.work is None:  # everything worth keeping is in the archive
    shutil.rmtree(work, ignore_errors=True)
  return rc


if __name__ == "__main__":
  sys.exit(main())
