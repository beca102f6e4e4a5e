"""``python -m bench.device``: everything worth measuring on a lent accelerator, in one command.

GPU time comes in short slices (one command of at most 10 minutes), so this is the prepared plan, each
step a subprocess with its own time limit and log, run in priority order; a failing or timed-out step is
recorded and the next one still runs:

  1. env      device, jax / jaxlib / python versions, nvidia-smi
  2. gpu      the `gpu`-marked tests: Triton and Mosaic GPU kernels against the reference on hardware,
              at production shapes (what the CPU interpreters cannot check: layouts, TMA, wgmma)
  3. tune     the autotuner (``bench.tune``) at the bench's shapes -> tuning/<device-kind>.json, copied
              into kernels/tuning/ so that impl="auto" picks it up
  4. bench    ``python -m bench`` at --size large: grpo_loss, fused_linear, paged_attention (ours, the
              Mosaic GPU kernel, jax's shipped op), optim, and the rollout suite (Qwen2.5-0.5B shape)
  5. parity   a short ``bench.parity``: the loop's xla vs pallas loss, step_avg on the 0.5B config

Everything lands in one results directory (default bench/results/device-<device>-<time>/): device.json
(per step: command, return code, wall time), summary.md, logs/, and each step's own outputs.

Runs from a plain checkout with the machine's preinstalled jax (no package index needed)::

    PYTHONPATH=. python -m bench.device                 # on the GPU (~8 minutes)
    PYTHONPATH=. python -m bench.device --dry-run       # print the plan only
    PYTHONPATH=. python -m bench.device --size tiny     # the whole path at tiny sizes, any host
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
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ("env", "gpu", "tune", "bench", "parity")

# Per-step wall-clock limits (s) at --size large: 8 minutes in all, leaving the rest of a 10-minute
# command for start-up and copying results back. Parity (4 short loop runs) is last and the likeliest
# to hit its limit: `--step parity` runs it alone in a second call.
LIMITS = {"env": 20, "gpu": 60, "tune": 100, "bench": 150, "parity": 150}


@dataclasses.dataclass
class Step:
  name: str
  argv: list[str]
  limit_s: float
  skip_reason: str | None = None  # set when a precondition is missing (recorded, not run)


@dataclasses.dataclass
class StepResult:
  name: str
  argv: list[str]
  returncode: int | None
  wall_s: float
  timed_out: bool
  skipped: str | None
  log: str


_ENV_SCRIPT = """
import json, platform, shutil, subprocess, sys
import jax, jaxlib
out = dict(python=platform.python_version(), jax=jax.__version__, jaxlib=jaxlib.__version__,
           backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()])
if shutil.which("nvidia-smi"):
  out["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "nvidia_smi"}))
"""


def plan(size: str, out: pathlib.Path, data_path: pathlib.Path | None) -> list[Step]:
  py = sys.executable
  tiny = size == "tiny"
  scale = 4.0 if tiny else 1.0  # the CPU interpreters are slow; tiny is a plumbing check
  pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable"]
  gpu_tests = [
    *pytest,
    "-m",
    "gpu",
    "tests",
    f"--junitxml={out / 'gpu-tests.xml'}",
  ]
  config = "configs/cpu-default.yaml" if tiny else "configs/gpu-qwen2.5-0.5b.yaml"
  parity = [
    py,
    "-m",
    "bench.parity",
    "--config",
    config,
    "--seeds",
    "0",
    "1",
    "--arm",
    "xla: train.policy_loss_impl=xla",
    "--arm",
    "pallas: train.policy_loss_impl=pallas",
    "--out",
    str(out / "parity"),
    "train.warmup_sft_steps=0",
    f"train.steps={2 if tiny else 6}",  # step_avg: the median of the (up to 10) last steps
    f"train.prompts_per_step={4 if tiny else 8}",  # x group_size 8: whole micro-batches (32 / 16)
    f"sampling.max_new_tokens={8 if tiny else 64}",
    "eval.every=1000",
    f"data.eval_limit={4 if tiny else 64}",
    f"run.checkpoint_every={10**6}",
  ]
  skip_parity = None
  if data_path is not None:
    parity.append(f"data.path={data_path}")
    if not (data_path / "train.jsonl").exists():
      skip_parity = f"no GSM8K at {data_path} (pass --data DIR)"
  steps = [
    Step("env", [py, "-c", _ENV_SCRIPT, str(out / "env.json")], LIMITS["env"]),
    Step("gpu", gpu_tests, LIMITS["gpu"]),
    Step(
      "tune",
      [py, "-m", "bench.tune", "--size", size, "--out", str(out / "tuning")]
      + (["--op", "grpo_loss", "--repeats", "1"] if tiny else []),
      LIMITS["tune"],
    ),
    Step(
      "bench",
      [py, "-m", "bench", "--size", size, "--out", str(out / "bench"), "--no-plots"]
      + (
        ["--suite", "grpo_loss", "--repeats", "2", "--warmup", "1"]
        if tiny
        else ["--repeats", "5", "--rollout-repeats", "1"]
      ),
      LIMITS["bench"],
    ),
    Step("parity", parity, LIMITS["parity"], skip_parity),
  ]
  for s in steps:
    s.limit_s *= scale
  return steps


def run_step(step: Step, logs: pathlib.Path) -> StepResult:
  log = logs / f"{step.name}.log"
  if step.skip_reason:
    log.write_text(f"skipped: {step.skip_reason}\n")
    return StepResult(step.name, step.argv, None, 0.0, False, step.skip_reason, str(log))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  t0 = time.perf_counter()
  with log.open("w") as f:
    f.write(" ".join(step.argv) + "\n\n")
    f.flush()
    try:
      rc = subprocess.run(
        step.argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=step.limit_s
      ).returncode
      timed_out = False
    except subprocess.TimeoutExpired:
      rc, timed_out = None, True
  return StepResult(step.name, step.argv, rc, time.perf_counter() - t0, timed_out, None, str(log))


def install_cache(out: pathlib.Path) -> list[str]:
  """Copy the tuned caches into kernels/tuning/ (committed: impl="auto" reads them)."""
  from kernels import autotune

  copied = []
  for path in sorted((out / "tuning").glob("*.json")):
    autotune.TUNING_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, autotune.TUNING_DIR / path.name)
    copied.append(str(autotune.TUNING_DIR / path.name))
  return copied


def summary(results: list[StepResult], meta: dict) -> str:
  lines = [
    f"# device run: {meta.get('device')} — jax {meta.get('jax')} — {meta['date']} — {meta['commit']}",
    "",
    "| step | status | wall (s) | log |",
    "|---|---|---|---|",
  ]
  for r in results:
    if r.skipped:
      status = f"skipped: {r.skipped}"
    elif r.timed_out:
      status = "TIMED OUT"
    else:
      status = "ok" if r.returncode == 0 else f"FAILED (rc {r.returncode})"
    lines.append(f"| {r.name} | {status} | {r.wall_s:.1f} | {pathlib.Path(r.log).name} |")
  return "\n".join(lines) + "\n"


def _commit() -> str | None:
  try:
    return subprocess.run(
      ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
  except OSError:
    return None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench.device", description=__doc__.split("\n")[0])
  p.add_argument("--size", default="large", choices=("tiny", "large"))
  p.add_argument("--out", type=pathlib.Path, help="results dir (default bench/results/device-...)")
  p.add_argument("--step", action="append", choices=STEPS, help="repeatable; default: all")
  p.add_argument("--data", type=pathlib.Path, help="GSM8K dir for the parity step")
  p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
  p.add_argument("--no-install-cache", action="store_true", help="leave kernels/tuning/ untouched")
  a = p.parse_args(argv)
  import jax  # after argparse: --help needs no backend

  kind = jax.devices()[0].device_kind
  slug = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
  out = (a.out or ROOT / "bench" / "results" / f"device-{slug}-{stamp}").resolve()
  steps = [s for s in plan(a.size, out, a.data) if not a.step or s.name in a.step]
  if a.dry_run:
    for s in steps:
      note = f"  [skip: {s.skip_reason}]" if s.skip_reason else ""
      shown = ["<env script>" if "\n" in arg else arg for arg in s.argv]
      print(f"{s.name:7s} (<= {s.limit_s:.0f}s): {' '.join(shown)}{note}")
    return 0
  logs = out / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  results = []
  for s in steps:
    print(f"[device] {s.name} (limit {s.limit_s:.0f}s) ...", flush=True)
    r = run_step(s, logs)
    results.append(r)
    print(f"[device] {s.name}: rc={r.returncode} {r.wall_s:.1f}s {r.skipped or ''}", flush=True)
  meta = dict(
    device=kind,
    jax=jax.__version__,
    size=a.size,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    commit=_commit(),
  )
  tuned = results and any(r.name == "tune" and r.returncode == 0 for r in results)
  meta["installed_cache"] = (
    install_cache(out) if tuned and a.size != "tiny" and not a.no_install_cache else []
  )
  (out / "device.json").write_text(
    json.dumps(dict(meta, steps=[dataclasses.asdict(r) for r in results]), indent=1) + "\n"
  )
  (out / "summary.md").write_text(summary(results, meta))
  print(f"[device] wrote {out}")
  failed = [r.name for r in results if not r.skipped and r.returncode != 0]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
