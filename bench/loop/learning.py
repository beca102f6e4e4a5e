"""Does the loop learn? One config over several seeds: the training correctness reward of the first
vs the last steps, eval_full before vs after GRPO, and the reward curves (mean and band over seeds).

    python -m bench.loop.learning --config configs/cpu-default.yaml --seeds 0 1 2 [key=value ...]

Writes learning.json, learning.md and reward_curve.png into --out (default
bench/results/learning-<time>/). The verdict applies the embedded default's bar (issue 17): the mean
`reward/correct/mean` of the last `window` steps exceeds that of the first `window` by at least
`--min-reward-gain` on average over seeds, and every seed's eval_full accuracy rises by at least
`--min-eval-se` standard errors of the difference (see `rl.run.evaluate.accuracy_change`).

`--agent` runs `python -m rl.agent` (multi-turn episodes, GRPO or PPO by train.algorithm) instead of
`python -m rl.train`; its curve is the training episodes' success rate (`env/success_rate`) and
eval_full its greedy success rate on held-out layouts / problems.

`bench.parity` reads each of its arms' runs with `summarize` and plots them with `plot_curves`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence

import numpy as np

from rl import train
from rl.logging.metrics import read_metrics
from rl.run.evaluate import accuracy_change

REWARD = "reward/correct/mean"
SUCCESS = "env/success_rate"  # rl.agent's per-step figure (it has no single-answer correctness)


def steady_step_time(steps: list[dict], last: int = 10) -> dict:
  """`step_avg_s`: the median step time of the last `last` steps that compiled nothing
  (`time/train/compiles` == 0; rows written before that metric existed all count), robust to one
  slow step; `step_avg_steps`: how many steps it is over (0: every step compiled, the figure NaN)."""
  steady = [m["time/train/step_s"] for m in steps if m.get("time/train/compiles", 0) == 0][-last:]
  return {
    "step_avg_s": statistics.median(steady) if steady else float("nan"),
    "step_avg_steps": len(steady),
  }


def summarize(run_dir: str, window: int = 10) -> dict:
  """One run's learning figures from its metrics.jsonl: reward curve, first / last `window` steps'
  mean correctness reward, eval_full before (the step-0 row) and after (the last one), step_avg."""
  lines = read_metrics(run_dir)
  steps = [m for m in lines if "time/train/step_s" in m]
  full = [m for m in lines if "eval_full/accuracy" in m]
  key = SUCCESS if steps and REWARD not in steps[0] and SUCCESS in steps[0] else REWARD
  curve = [m[key] for m in steps]
  w = max(1, min(window, len(curve) // 2))
  before = next((m for m in full if m["step"] == 0), None)
  after = full[-1] if full and full[-1]["step"] > 0 else None
  out = {
    "steps": len(steps),
    "window": w,
    "reward_key": key,
    "reward_curve": curve,
    "reward_first": statistics.fmean(curve[:w]) if curve else float("nan"),
    "reward_last": statistics.fmean(curve[-w:]) if curve else float("nan"),
    **steady_step_time(steps),
    "eval_before": before["eval_full/accuracy"] if before else float("nan"),
    "eval_after": after["eval_full/accuracy"] if after else float("nan"),
    "eval_examples": (after or before or {}).get("eval_full/examples", 0),
  }
  out["reward_gain"] = out["reward_last"] - out["reward_first"]
  out["eval_gain"], out["eval_gain_se"] = accuracy_change(
    out["eval_before"], out["eval_after"], out["eval_examples"]
  )
  return out


def run_seed(
  config: str, overrides: Sequence[str], seed: int, run_dir: str, agent: bool = False
) -> None:
  """One full run of `config` (+ overrides) with `train.seed=seed` into `run_dir`, eval_full at the
  end (and its step-0 baseline), as `summarize` reads it; `agent`: rl.agent's multi-turn loop."""
  if agent:
    from rl.agent import (
      __main__ as entry,  # imported on demand: the single-turn bench never needs it
    )
  else:
    entry = train
  entry.main(
    [
      "--config",
      config,
      *overrides,
      f"train.seed={seed}",
      f"run.out_dir={run_dir}",
      "eval.full_at_end=true",
    ]
  )


def verdict(runs: Mapping[int, dict], min_reward_gain: float, min_eval_se: float) -> dict:
  gains = [r["reward_gain"] for r in runs.values()]
  ses = [r["eval_gain_se"] for r in runs.values()]
  reward_ok = statistics.fmean(gains) >= min_reward_gain
  eval_ok = all(se >= min_eval_se for se in ses)
  return {
    "reward_gain_mean": statistics.fmean(gains),
    "reward_first_mean": statistics.fmean(r["reward_first"] for r in runs.values()),
    "reward_last_mean": statistics.fmean(r["reward_last"] for r in runs.values()),
    "eval_before_mean": statistics.fmean(r["eval_before"] for r in runs.values()),
    "eval_after_mean": statistics.fmean(r["eval_after"] for r in runs.values()),
    "eval_gain_se_min": min(ses),
    "reward_ok": reward_ok,
    "eval_ok": eval_ok,
    "learns": reward_ok and eval_ok,
  }


def markdown(name: str, runs: Mapping[int, dict], v: dict, bars: tuple[float, float]) -> str:
  first = next(iter(runs.values()))
  w, what = first["window"], reward_label(first)
  lines = [
    f"| {name}: seed | {what}, first {w} steps | last {w} | gain | eval_full before | "
    "after | change (SE) | step_avg (s) |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for seed, r in runs.items():
    lines.append(
      f"| {seed} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | {r['reward_gain']:+.3f} | "
      f"{r['eval_before']:.3f} | {r['eval_after']:.3f} | {r['eval_gain']:+.3f} "
      f"({r['eval_gain_se']:+.1f}) | {r['step_avg_s']:.2f} |"
    )
  lines.append(
    f"| mean | {v['reward_first_mean']:.3f} | {v['reward_last_mean']:.3f} | "
    f"{v['reward_gain_mean']:+.3f} | {v['eval_before_mean']:.3f} | {v['eval_after_mean']:.3f} | "
    f"min {v['eval_gain_se_min']:+.1f} SE | |"
  )
  mark = lambda ok: "yes" if ok else "NO"
  lines += [
    "",
    f"- reward gain >= {bars[0]:+.2f} (mean over seeds): {mark(v['reward_ok'])}",
    f"- eval_full rise >= {bars[1]:.0f} SE (every seed): {mark(v['eval_ok'])}",
  ]
  return "\n".join(lines) + "\n"


def reward_label(run: dict) -> str:  # the curve's name in the reports
  return "success rate" if run.get("reward_key") == SUCCESS else "correct reward"


def plot_curves(arms: Mapping[str, Mapping[int, dict]], path: str, smooth: int = 5) -> None:
  """Per arm: the correctness reward per step, mean over seeds (a `smooth`-step moving average, solid)
  over the band from the lowest to the highest seed (raw, shaded); eval_full before / after per arm on
  the right."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return  # the numbers are in the JSON; the plot needs matplotlib (the dev extra)
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
  for i, (name, runs) in enumerate(arms.items()):
    n = min(len(r["reward_curve"]) for r in runs.values())
    if n == 0:
      continue
    curves = np.array([r["reward_curve"][:n] for r in runs.values()])  # [seeds, steps]
    x = np.arange(1, n + 1)
    mean = curves.mean(0)
    k = max(1, min(smooth, n))
    smoothed = np.convolve(mean, np.ones(k) / k, mode="valid")
    ax.fill_between(x, curves.min(0), curves.max(0), color=f"C{i}", alpha=0.2)
    ax.plot(x[k - 1 :], smoothed, color=f"C{i}", label=f"{name} ({len(runs)} seeds)")
    before = [r["eval_before"] for r in runs.values()]
    after = [r["eval_after"] for r in runs.values()]
    offset = 0.35 * i / max(1, len(arms) - 1) - 0.175 if len(arms) > 1 else 0.0
    for x0, vals in ((0, before), (1, after)):
      bx.scatter(np.full(len(vals), x0 + offset), vals, color=f"C{i}", s=18)
    bx.plot([offset, 1 + offset], [np.mean(before), np.mean(after)], color=f"C{i}")
  first = next(iter(next(iter(arms.values())).values()))
  ax.set_xlabel("RL step")
  ax.set_ylabel(f"training {first.get('reward_key', REWARD)}")
  ax.set_title(f"mean over seeds ({smooth}-step moving average); band: min to max")
  ax.set_ylim(bottom=0)
  ax.legend(loc="upper left")
  ax.grid(alpha=0.3)
  bx.set_xticks([0, 1], ["before", "after RL"])
  bx.set_xlim(-0.5, 1.5)
  bx.set_ylabel("eval_full accuracy (greedy)")
  bx.set_title("eval_full per seed")
  bx.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(
    prog="python -m bench.loop.learning", description=__doc__.split("\n\n")[0]
  )
  ap.add_argument("--config", required=True)
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--window", type=int, default=10, help="steps averaged at each end of the curve")
  ap.add_argument(
    "--agent", action="store_true", help="run rl.agent (multi-turn episodes) instead of rl.train"
  )
  ap.add_argument("--min-reward-gain", type=float, default=0.25)
  ap.add_argument("--min-eval-se", type=float, default=3.0)
  ap.add_argument("--out", default=None)
  ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every seed's run")
  args = ap.parse_intermixed_args(argv)
  if args.window < 1:
    raise SystemExit(f"--window must be >= 1, got {args.window}")
  out = args.out or os.path.join("bench", "results", time.strftime("learning-%Y%m%d-%H%M%S"))
  runs: dict[int, dict] = {}
  t0 = time.perf_counter()
  for seed in args.seeds:
    run_dir = os.path.join(out, f"seed{seed}")
    run_seed(args.config, args.overrides, seed, run_dir, args.agent)
    runs[seed] = summarize(run_dir, args.window)
    runs[seed]["wall_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
  bars = (args.min_reward_gain, args.min_eval_se)
  v = verdict(runs, *bars)
  report = {
    "config": args.config,
    "overrides": args.overrides,
    "entry": "rl.agent" if args.agent else "rl.train",
    "seeds": args.seeds,
    "runs": runs,
    "verdict": v,
  }
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "learning.json"), "w") as f:
    json.dump(report, f, indent=1)
  text = markdown(os.path.basename(args.config), runs, v, bars)
  with open(os.path.join(out, "learning.md"), "w") as f:
    f.write(text)
  plot_curves({os.path.basename(args.config): runs}, os.path.join(out, "reward_curve.png"))
  print(text)
  print(f"wrote {out}/learning.json, learning.md, reward_curve.png")
  return report


if __name__ == "__main__":
  main()
