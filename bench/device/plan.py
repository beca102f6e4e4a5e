"""The steps of ``python -m bench.device``'s three calls and their wall-clock limits.

Limits at --size large come from the first H100 run (NVIDIA H100 80GB HBM3, jax 0.11.2, commit
46db0ec, 2026-11-24; ../shared/device-runs/h100-2026-11-24), each call's sum within CALL_BUDGET_S (a
device command is at most 10 minutes; the rest is start-up and copying back). Measured then, per suite
process: grpo_loss 83 s, paged_attention 16 s, mosaic_gpu 105 s, fused_linear 62 s, optim > 160 s,
`pytest -m gpu` 101-105 s, the rollout suite ~160 s; the loop's first step 62-64 s (compiles), later
steps 1.2 s, one more update compile ~50 s. 20-36 s of every large case was the parity check's
host copy, now reduced on the device, so the kernel suites' limits are below their old wall times;
these are estimates until a device run measures them (the archive records every step's wall time).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

CALLS = ("kernels", "tune", "loop")
CALL_BUDGET_S = 540  # 9 minutes of a 10-minute command
KERNEL_SUITES = ("grpo_loss", "paged_attention", "mosaic_gpu", "fused_linear", "optim")
TUNE_OPS = ("grpo_loss", "paged_attention", "optim", "fused_linear")
GPU_CONFIG = "configs/gpu-qwen2.5-0.5b.yaml"
PEERS_JAX_MEMORY_FRACTION = 0.6  # jax takes this much of the GPU in the peers step; torch the rest
# The kernel suites' jax share (default 0.75): AdamW at the 1.5B shape needs 57.5 GiB by XLA's memory
# analysis (inputs 23.0 + reference outputs 17.25 + the kernel's outputs held for parity 17.25; CPU
# compile of the same case), which 0.75 of an 80 GB H100 (~59 GiB) barely holds; 0.9 leaves room.
KERNELS_JAX_MEMORY_FRACTION = 0.9

LARGE_LIMITS = {
  "kernels": {
    "env": 20,
    "gpu-tests": 130,  # measured 101-105 s
    "grpo_loss": 60,  # 83 s, ~60 of it host parity copies: compile < 3 s per side, repeats < 0.1 s
    "paged_attention": 40,  # 16 s
    "mosaic_gpu": 90,  # 105 s with host parity
    "fused_linear": 60,  # 62 s with host parity
    "optim": 100,  # > 160 s: ~35 s per case, parameter trees copied to the host for parity
    "peers": 40,  # new: Liger-Kernel / tokamax rows
  },
  "tune": {"env": 20, "grpo_loss": 150, "paged_attention": 90, "optim": 120, "fused_linear": 120},
  "loop": {
    "env": 20,
    "rollout": 180,  # measured ~160 s
    "parity": 250,  # 4 runs: each arm's first seed compiles (~2 x 60 s), the second reads the cache
    "profile": 70,  # 3 steps from the warm cache, steps 2-3 traced
    "trace": 20,
  },
}
TINY_LIMIT = 240  # CPU rehearsal: interpreters and compiles on 2 cores; not a device budget
TUNE_SLACK_S = 45  # of a tune step's limit: start-up and problem set-up, outside the op's budget


@dataclasses.dataclass(frozen=True)
class Step:
  name: str
  argv: list[str]  # with jax: a module and its arguments (run through the launcher); else a command
  limit_s: float
  jax: bool = True
  results: str | None = None  # where the step writes its results, relative to the work dir
  memory_fraction: float | None = None  # of the GPU jax may take (sharing it with torch)
  skip_reason: str | None = None  # a missing precondition: recorded, not run

  def __post_init__(self):
    if not self.limit_s > 0:
      raise ValueError(f"step {self.name}: limit_s must be > 0, got {self.limit_s}")


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


def _env(work: pathlib.Path, limit: float) -> Step:
  return Step("env", [sys.executable, "-c", _ENV_SCRIPT, str(work / "env.json")], limit, jax=False)


def _bench(name: str, suite: str, size: str, work: pathlib.Path, limit: float, **kw) -> Step:
  tiny = size == "tiny"
  argv = ["bench", "--size", size, "--suite", suite, "--no-plots", "--no-history"]
  argv += ["--out", str(work / name)]
  argv += (
    ["--repeats", "1", "--warmup", "0", "--no-measure-bandwidth"] if tiny else ["--repeats", "10"]
  )
  if suite == "rollout":
    argv += ["--rollout-repeats", "1"]
  return Step(name, argv, limit, results=name, **kw)


def kernels_steps(size: str, work: pathlib.Path, limit) -> list[Step]:
  tiny = size == "tiny"
  where = (
    ["tests/kernels/paged_attention/test_mosaic_gpu.py"] if tiny else ["tests"]
  )  # tiny: all skip
  pytest = ["pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable", "-m", "gpu", *where]
  pytest.append(f"--junitxml={work / 'gpu-tests.xml'}")
  steps = [_env(work, limit("env")), Step("gpu-tests", pytest, limit("gpu-tests"))]
  mem = KERNELS_JAX_MEMORY_FRACTION
  steps += [_bench(s, s, size, work, limit(s), memory_fraction=mem) for s in KERNEL_SUITES]
  frac = PEERS_JAX_MEMORY_FRACTION
  steps.append(_bench("peers", "peers", size, work, limit("peers"), memory_fraction=frac))
  return steps


def tune_steps(size: str, work: pathlib.Path, limit) -> list[Step]:
  steps = [_env(work, limit("env"))]
  for op in TUNE_OPS:
    budget = 30.0 if size == "tiny" else max(limit(op) - TUNE_SLACK_S, 10.0)
    argv = ["bench.tune", "--size", size, "--op", op, "--out", str(work / "tuning")]
    argv += ["--budget-s", f"{budget:.0f}", "--repeats", "1" if size == "tiny" else "5"]
    steps.append(Step(op, argv, limit(op), results="tuning"))
  return steps


def loop_overrides(size: str, data: pathlib.Path | None) -> list[str]:
  """Every run of the loop call: short runs, and on GPU a sequence room just above GSM8K's longest
  prompt (1134 tokens + 64 new; the first H100 run stopped at the config's old 1024) and the
  materialised-logits loss in both arms, so xla vs pallas compares grpo_loss's kernels alone (the
  fused LM-head arms are another comparison). tests/rl/config/test_config.py runs --check on exactly these."""
  tiny = size == "tiny"
  out = ["train.warmup_sft_steps=0", f"train.steps={2 if tiny else 3}"]
  out += [
    "train.prompts_per_step=8",  # x group_size 8: one 64-row micro-batch (cpu-default: 64)
    f"sampling.max_new_tokens={8 if tiny else 64}",
  ]
  out += [
    "eval.every=1000",
    f"data.eval_limit={4 if tiny else 64}",
    f"run.checkpoint_every={10**6}",
  ]
  if not tiny:
    out += ["rollout.max_seq_len=1280", "train.fused_lm_head=false"]
  if data is not None:
    out.append(f"data.path={data}")
  return out


def loop_steps(size: str, work: pathlib.Path, limit, data: pathlib.Path | None) -> list[Step]:
  tiny = size == "tiny"
  config = "configs/cpu-default.yaml" if tiny else GPU_CONFIG
  over = loop_overrides(size, data)
  skip = None
  if not tiny:
    path = data or pathlib.Path(__file__).resolve().parents[2] / "../shared/data/gsm8k"
    if not (path / "train.jsonl").exists():
      skip = f"no GSM8K at {path} (pass --data DIR)"
  parity = ["bench.parity", "--config", config, "--seeds", "0", "1", "--out", str(work / "parity")]
  parity += [
    "--arm",
    "xla: train.policy_loss_impl=xla",
    "--arm",
    "pallas: train.policy_loss_impl=pallas",
  ]
  profile = ["rl.train", "--config", config, *over, "train.policy_loss_impl=xla"]
  profile.append(f"run.profile_steps={1 if tiny else 2}")  # after the compiling first step
  profile += [f"run.profile_dir={work / 'profile'}", f"run.out_dir={work / 'profile-run'}"]
  return [
    _env(work, limit("env")),
    _bench("rollout", "rollout", size, work, limit("rollout")),
    Step("parity", [*parity, *over], limit("parity"), results="parity", skip_reason=skip),
    Step("profile", profile, limit("profile"), skip_reason=skip),
    Step("trace", ["bench.trace", str(work / "profile")], limit("trace"), skip_reason=skip),
  ]


def plan(
  call: str,
  size: str,
  work: pathlib.Path,
  data: pathlib.Path | None = None,
  limits: dict[str, float] | None = None,
  only: list[str] | None = None,
) -> list[Step]:
  """The steps of ``call`` at ``size`` writing under ``work``; ``limits`` overrides per step name,
  ``only`` keeps the named steps."""
  if call not in CALLS:
    raise ValueError(f"call must be one of {CALLS}, got {call!r}")
  if size not in ("tiny", "large"):
    raise ValueError(f"size must be 'tiny' or 'large', got {size!r}")
  limits = dict(limits or {})
  table = LARGE_LIMITS[call]
  unknown = sorted((set(limits) | set(only or ())) - set(table))
  if unknown:
    raise ValueError(f"unknown step(s) {unknown} for --call {call}; its steps: {list(table)}")
  limit = lambda name: limits.get(name, TINY_LIMIT if size == "tiny" else table[name])
  if call == "kernels":
    steps = kernels_steps(size, work, limit)
  elif call == "tune":
    steps = tune_steps(size, work, limit)
  else:
    steps = loop_steps(size, work, limit, data)
  return [s for s in steps if not only or s.name in only]
