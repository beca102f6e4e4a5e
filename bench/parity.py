"""End-to-end parity runs: the GRPO loop with two (or more) variants over several seeds.

    python -m bench.parity --config configs/cpu-default.yaml --seeds 0 1 2 \\
        --arm "xla: train.policy_loss_impl=xla" --arm "pallas: train.policy_loss_impl=pallas" [override ...]

Each seed starts every arm from the same initial model, data order and sampling seeds (all functions
of train.seed), so arms are compared seed by seed (paired). Per arm: step_avg (median of the last 10
steady step times: steps that compiled are left out; the report says over how many) and eval_full/accuracy; per other arm against the first: the mean paired difference with
a 95% t-interval. "parity" is stated only when the interval contains 0 and lies within +-margin;
one seed is never enough (at least two are required). `--agent` runs rl.agent's multi-turn loop in every
arm (e.g. PPO with its critic: configs/cpu-grid.yaml), compared the same way on its greedy eval_full
success rate.

    python -m bench.parity --wandb-summaries RUN_A RUN_B

prints the seed runs' comparison table of two finished runs from their W&B summaries (a run's
`run.out_dir` with `run.wandb.mode` set, an offline run directory, a `run-<id>.wandb` log or a
`wandb-summary.json`; read offline by `rl.logging.wandb_summary`): eval_full accuracy, the eval correctness
reward, step_avg_last10 and the eval_full step time, each with B - A.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence

from bench.loop import learning
from rl.logging.wandb_sink import ALIASES
from rl.logging.wandb_summary import read_summary

# Two-sided 95% Student t quantiles by degrees of freedom (beyond the table: the normal's 1.96).
_T975 = {
  1: 12.706,
  2: 4.303,
  3: 3.182,
  4: 2.776,
  5: 2.571,
  6: 2.447,
  7: 2.365,
  8: 2.306,
  9: 2.262,
  10: 2.228,
  12: 2.179,
  15: 2.131,
  20: 2.086,
  30: 2.042,
}


def t_quantile(df: int) -> float:
  if df < 1:
    raise ValueError("a confidence interval needs at least two paired runs")
  keys = [k for k in sorted(_T975) if k <= df]
  return _T975[keys[-1]] if df <= 30 else 1.96


def paired_interval(diffs: Sequence[float]) -> tuple[float, float, float]:
  """(mean, low, high): the 95% t-interval of the mean of paired differences."""
  n = len(diffs)
  mean = statistics.fmean(diffs)
  half = t_quantile(n - 1) * statistics.stdev(diffs) / math.sqrt(n)
  return mean, mean - half, mean + half


def verdict(low: float, high: float, margin: float) -> str:
  if low <= 0 <= high and -margin <= low and high <= margin:
    return "parity"
  if low > 0 or high < 0:
    return "differs"
  return "inconclusive (interval wider than the margin: more seeds)"


def _arm(text: str) -> list[str]:
  name, sep, rest = text.partition(":")
  if not sep or not name.strip():
    raise argparse.ArgumentTypeError(f"--arm takes 'NAME: key=value ...', got {text!r}")
  return [name.strip(), *rest.split()]


def run_summary(run_dir: str) -> dict:
  """`bench.loop.learning.summarize` of one run, plus the two figures the arms are compared on."""
  out = learning.summarize(run_dir)
  out["eval_full_accuracy"] = out["eval_after"]
  return out


# The seed runs' comparison table: (row label, their summary key).
WANDB_ROWS = (
  ("eval_full accuracy", "eval_full/accuracy"),
  ("eval correct reward", "eval/reward/func/reward_correct/mean"),
  ("step_avg_last10 (s)", "time/train/step_avg_last10_s"),
  ("eval_full step time (s)", "time/eval_full/step_s"),
)
_OURS = {theirs: ours for ours, theirs in ALIASES.items()}


def _figure(summary: dict, key: str) -> float | None:
  """`key` of a summary, or our name for it (a summary written before the alias was logged)."""
  value = summary.get(key, summary.get(_OURS.get(key, key)))
  return None if value is None else float(value)


def wandb_comparison(path_a: str, path_b: str) -> dict:
  """The table's figures of two runs' W&B summaries: per key A, B and B - A (None where missing)."""
  a, b = read_summary(path_a), read_summary(path_b)
  rows = {}
  for label, key in WANDB_ROWS:
    va, vb = _figure(a, key), _figure(b, key)
    delta = None if va is None or vb is None else vb - va
    rows[key] = {"label": label, "a": va, "b": vb, "delta": delta}
  return {"a": path_a, "b": path_b, "rows": rows}


def wandb_markdown(cmp: dict) -> str:
  """The comparison as a table; a time's change also as a percentage of A's."""
  cell = lambda v: "missing" if v is None else f"{v:.4f}"
  lines = [
    f"A: {cmp['a']}",
    f"B: {cmp['b']}",
    "",
    "| metric | A | B | B - A |",
    "|---|---|---|---|",
  ]
  for key, r in cmp["rows"].items():
    delta = "" if r["delta"] is None else f"{r['delta']:+.4f}"
    if r["delta"] is not None and key.startswith("time/") and r["a"]:
      delta += f" ({100 * r['delta'] / r['a']:+.1f}%)"
    lines.append(f"| {r['label']} | {cell(r['a'])} | {cell(r['b'])} | {delta or 'n/a'} |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m bench.parity", description=__doc__.split("\n\n")[0])
  ap.add_argument(
    "--wandb-summaries",
    nargs=2,
    metavar=("RUN_A", "RUN_B"),
    help="compare two finished runs' W&B summaries (nothing runs; the other options are unused)",
  )
  ap.add_argument("--config")
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument(
    "--arm",
    action="append",
    type=_arm,
    help='"NAME: key=value key=value": one variant (the first is the baseline)',
  )
  ap.add_argument(
    "--margin-accuracy", type=float, default=0.05, help="parity margin on eval_full accuracy"
  )
  ap.add_argument(
    "--margin-step", type=float, default=0.1, help="parity margin on step_avg, as a fraction"
  )
  ap.add_argument(
    "--agent", action="store_true", help="run rl.agent (multi-turn episodes) instead of rl.train"
  )
  ap.add_argument("--out", default=None)
  ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every arm")
  args = ap.parse_intermixed_args(argv)
  if args.wandb_summaries:
    cmp = wandb_comparison(*args.wandb_summaries)
    print(wandb_markdown(cmp), end="")
    return cmp
  if not args.config or not args.arm:
    ap.error("the arms need --config and --arm (or give --wandb-summaries RUN_A RUN_B)")
  return run_arms(args)


def run_arms(args: argparse.Namespace) -> dict:
  """Every arm over every seed, then each arm against the first: parity.json, parity.md, curves."""
  if len(args.seeds) < 2:
    raise SystemExit("parity needs at least two seeds: one seed says nothing about the spread")
  if len(args.arm) < 2:
    raise SystemExit("give at least two --arm 'NAME: key=value ...' (the first is the baseline)")
  out = args.out or os.path.join("bench", "results", time.strftime("parity-%Y%m%d-%H%M%S"))
  results: dict[str, dict[int, dict]] = {}
  for name, *arm_overrides in args.arm:
    for seed in args.seeds:
      run_dir = os.path.join(out, name, f"seed{seed}")
      learning.run_seed(args.config, [*args.overrides, *arm_overrides], seed, run_dir, args.agent)
      results.setdefault(name, {})[seed] = run_summary(run_dir)
  report = {
    "config": args.config,
    "entry": "rl.agent" if args.agent else "rl.train",
    "seeds": args.seeds,
    "overrides": args.overrides,
    "arms": {n: {"overrides": o} for n, *o in args.arm},
    "runs": results,
    "comparisons": {},
  }
  base = args.arm[0][0]
  for name, *_ in args.arm[1:]:
    cmp = {}
    for key, margin in (("eval_full_accuracy", args.margin_accuracy), ("step_avg_s", None)):
      diffs = [results[name][s][key] - results[base][s][key] for s in args.seeds]
      if not all(map(math.isfinite, diffs)):  # a run with no steady (compile-free) step
        cmp[key] = {"mean_diff": math.nan, "ci95": [math.nan, math.nan], "margin": math.nan}
        cmp[key]["verdict"] = "no figure: a run had no step without compiles (more steps)"
        continue
      mean, low, high = paired_interval(diffs)
      if margin is None:  # relative to the baseline's mean step time
        margin = args.margin_step * statistics.fmean(results[base][s][key] for s in args.seeds)
      cmp[key] = {
        "mean_diff": mean,
        "ci95": [low, high],
        "margin": margin,
        "verdict": verdict(low, high, margin),
      }
    report["comparisons"][f"{name} - {base}"] = cmp
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "parity.json"), "w") as f:
    json.dump(report, f, indent=1)
  learning.plot_curves(results, os.path.join(out, "reward_curves.png"))
  with open(os.path.join(out, "parity.md"), "w") as f:
    f.write(markdown(report))
  print(markdown(report))
  return report


def markdown(report: dict) -> str:
  """Each run's learning figures (does every arm learn?), then the paired comparisons."""
  first = next(iter(next(iter(report["runs"].values())).values()))
  lines = [
    f"| arm | seed | step_avg (s, over steady steps) | {learning.reward_label(first)} first -> "
    "last steps | "
    "eval_full before -> after |",
    "|---|---|---|---|---|",
  ]
  for name, runs in report["runs"].items():
    for seed, r in runs.items():
      lines.append(
        f"| {name} | {seed} | {r['step_avg_s']:.4f} ({r.get('step_avg_steps', '?')}) | "
        f"{r['reward_first']:.3f} -> "
        f"{r['reward_last']:.3f} ({r['reward_gain']:+.3f}) | {r['eval_before']:.3f} -> "
        f"{r['eval_after']:.3f} ({r['eval_gain_se']:+.1f} SE) |"
      )
  lines += [
    "",
    "| comparison | metric | mean diff | 95% CI | margin | verdict |",
    "|---|---|---|---|---|---|",
  ]
  for cname, cmp in report["comparisons"].items():
    for key, c in cmp.items():
      lines.append(
        f"| {cname} | {key} | {c['mean_diff']:+.4f} | [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] | "
        f"±{c['margin']:.4f} | {c['verdict']} |"
      )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
