"""The loop's step time as a regression benchmark: a few GRPO steps of a config (no SFT, no eval),
their median step time, appended to a history file kept in git, and compared with the last row taken
on the same device, config and jax version.

    python -m bench.loop.step_time [--config configs/cpu-default.yaml] [--steps 12] [key=value ...]
    python -m bench --suite loop        # the same, inside the main bench report

A row is one JSON line of ``bench/history/loop.jsonl``: date, commit, device kind, jax version, the
config and overrides, and the medians of the step time and of its rollout / update phases over the
steady steps: after the first `skip`, those that compiled nothing (the loop's
`time/train/compiles`); `timed_steps` says how many, `compile_steps` how many compiled and were left
out, `compile_s` their compile seconds. A slower loop shows up as a ratio above 1 against the
previous row with the same key; above ``1 + tolerance`` it is called a regression (and with
``--fail-on-regression`` the command exits 1). CPU timings on a shared machine vary by 10-20 %: the
default tolerance is 0.25.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
from collections.abc import Sequence

import jax

from bench.provenance import git_commit
from rl import cli, train
from rl.logging.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
HISTORY = ROOT / "bench" / "history" / "loop.jsonl"
DEFAULT_CONFIG = "configs/cpu-default.yaml"
# The fields that make two rows comparable: the same work on the same software and hardware.
# `config_digest` is the resolved config's: a config file whose contents change (a new default) starts
# a new series instead of reading as a regression of the old one.
KEY = ("device_kind", "jax", "config", "config_digest", "overrides", "steps", "skip")


def config_digest(config: str, overrides: Sequence[str] = ()) -> str:
  """A short hash of the typed config the loop runs (YAML + overrides + defaults), `run.*` (paths,
  logging) left out: the same digest means the same work."""
  resolved = dataclasses.asdict(cli.parse_args(["--config", str(config), *overrides]))
  resolved.pop("run", None)
  text = json.dumps(resolved, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def measure(config: str, steps: int, skip: int, overrides: Sequence[str] = ()) -> dict:
  """Run `steps` GRPO steps of `config` (SFT and evals off) in a temporary directory; the medians of
  the step times after the first `skip`."""
  if steps <= skip:
    raise ValueError(f"steps ({steps}) must exceed skip ({skip}): the first steps compile")
  with tempfile.TemporaryDirectory(prefix="bench-loop-") as out:
    train.main(
      [
        "--config",
        str(config),
        *overrides,
        f"train.steps={steps}",
        "train.warmup_sft_steps=0",
        "eval.every=0",
        "eval.full_every=0",
        "eval.full_at_end=false",
        "run.progress=false",
        "run.tensorboard=false",
        f"run.out_dir={out}",
      ]
    )
    rows = [m for m in read_metrics(out) if "time/train/step_s" in m][skip:]
  compiling = [m for m in rows if m.get("time/train/compiles", 0) > 0]
  rows = [m for m in rows if m.get("time/train/compiles", 0) == 0]
  if not rows:
    raise ValueError(
      f"every one of the {steps - skip} steps after skip={skip} compiled: more steps"
    )
  median = lambda key: statistics.median(m[key] for m in rows)
  return {
    "step_s": median("time/train/step_s"),
    "step_s_min": min(m["time/train/step_s"] for m in rows),
    "step_s_max": max(m["time/train/step_s"] for m in rows),
    "rollout_s": median("time/train/rollout_s"),
    "update_s": median("time/train/update_s"),
    "tokens_per_s": median("rollout/tokens_per_s"),
    "timed_steps": len(rows),
    "compile_steps": len(compiling),
    "compile_s": sum(m["time/train/compile_s"] for m in compiling),
  }


def row_for(config: str, steps: int, skip: int, overrides: Sequence[str], timing: dict) -> dict:
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "commit": git_commit(),
    "device_kind": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "config": str(config),
    "config_digest": config_digest(config, overrides),
    "overrides": list(overrides),
    "steps": steps,
    "skip": skip,
    **timing,
  }


def read_history(path: os.PathLike | str = HISTORY) -> list[dict]:
  """Every row of a history file; a missing file is an empty history, a corrupt line an error naming
  the file and line (a history is kept in git: a bad merge should be seen, not skipped)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  rows = []
  for i, line in enumerate(path.read_text().splitlines(), 1):
    if line.strip():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i}: not a JSON row ({e})") from None
  return rows


def compare(row: dict, history: Sequence[dict], tolerance: float) -> dict:
  """`row` against the last earlier row with the same KEY: the step-time ratio and the verdict."""
  same = [h for h in history if all(h.get(k) == row[k] for k in KEY)]
  if not same:
    return {"previous": None, "ratio": None, "verdict": "first row for this device / config / jax"}
  prev = same[-1]
  ratio = row["step_s"] / prev["step_s"]
  verdict = "regression" if ratio > 1 + tolerance else ("faster" if ratio < 1 - tolerance else "ok")
  return {"previous": prev, "ratio": ratio, "verdict": verdict}


def append(row: dict, path: os.PathLike | str = HISTORY) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")


def describe(row: dict, cmp: dict) -> str:
  text = (
    f"loop step time ({row['config']}, {row['timed_steps']} steady steps on {row['device_kind']}, "
    f"{row.get('compile_steps', 0)} compiling left out): "
    f"median {row['step_s']:.3f} s [{row['step_s_min']:.3f}, {row['step_s_max']:.3f}] "
    f"(rollout {row['rollout_s']:.3f} s, update {row['update_s']:.3f} s)"
  )
  if cmp["previous"] is None:
    return text + f"; {cmp['verdict']}"
  prev = cmp["previous"]
  return text + (
    f"; {cmp['ratio']:.2f}x the previous row ({prev['step_s']:.3f} s, commit "
    f"{(prev.get('commit') or '?')[:10]}, {prev['date']}): {cmp['verdict']}"
  )


def run(
  config: str = DEFAULT_CONFIG,
  steps: int = 12,
  skip: int = 2,
  overrides: Sequence[str] = (),
  history: os.PathLike | str | None = HISTORY,
  tolerance: float = 0.25,
) -> tuple[dict, dict]:
  """Measure, compare with the history, append the row (history None: compare with nothing, keep
  nothing). Returns (row, comparison)."""
  if tolerance <= 0:
    raise ValueError(f"tolerance must be > 0, got {tolerance}")
  row = row_for(config, steps, skip, overrides, measure(config, steps, skip, overrides))
  cmp = compare(row, read_history(history) if history else [], tolerance)
  if history:
    append(row, history)
  return row, cmp


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m bench.loop.step_time", description=__doc__.split("\n\n")[0]
  )
  ap.add_argument("--config", default=DEFAULT_CONFIG)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--skip", type=int, default=2, help="first steps left out of the median")
  ap.add_argument("--history", default=str(HISTORY), help="JSON-lines file ('' keeps nothing)")
  ap.add_argument("--tolerance", type=float, default=0.25)
  ap.add_argument("--fail-on-regression", action="store_true")
  ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
  args = ap.parse_intermixed_args(argv)
  try:
    row, cmp = run(
      args.config, args.steps, args.skip, args.overrides, args.history or None, args.tolerance
    )
  except ValueError as e:
    ap.error(str(e))
  print(describe(row, cmp))
  if args.history:
    print(f"appended to {args.history}")
  return 1 if args.fail_on_regression and cmp["verdict"] == "regression" else 0


if __name__ == "__main__":
  sys.exit(main())
