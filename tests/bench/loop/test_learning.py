"""bench.loop.learning: the learning figures from a hand-written metrics.jsonl, the verdict, the report, and
one tiny end-to-end run."""

import json
import math

import pytest

from bench.loop import learning
from tests.rl.test_train import TINY


def _write(run_dir, rows):
  run_dir.mkdir(parents=True, exist_ok=True)
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _step(step, reward, seconds=1.0):
  return {"step": step, "time/train/step_s": seconds, learning.REWARD: reward}


def test_step_avg_leaves_out_every_step_that_compiled():
  """A 50 s recompile in step 6 (issue 31: the update recompiled mid-run on an H100) neither enters
  the median nor counts as a timed step; rows from before the compile metric all count. Catches a
  step_avg that averages compile time in (38 s read where the steady step took 1.2 s)."""
  steps = [
    {"time/train/step_s": s, "time/train/compiles": c}
    for s, c in [(64.0, 40), (1.2, 0), (1.3, 0), (1.1, 0), (1.25, 0), (50.0, 2), (1.2, 0)]
  ]
  assert learning.steady_step_time(steps) == {"step_avg_s": 1.2, "step_avg_steps": 5}
  assert learning.steady_step_time(steps, last=2) == {"step_avg_s": 1.225, "step_avg_steps": 2}
  old = [{"time/train/step_s": s} for s in (3.0, 1.0, 2.0)]  # written before compiles existed
  assert learning.steady_step_time(old) == {"step_avg_s": 2.0, "step_avg_steps": 3}
  nan = learning.steady_step_time(steps[:1])
  assert nan["step_avg_steps"] == 0 and math.isnan(nan["step_avg_s"])


def _full(step, acc, n=100):
  return {"step": step, "eval_full/accuracy": acc, "eval_full/examples": n}


def test_summarize_by_hand(tmp_path):
  rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
  _write(
    tmp_path,
    [{"step": 1, "sft/loss": 2.0}, _full(0, 0.2)]  # SFT rows share step numbers with GRPO's
    + [_step(i + 1, r, seconds=10.0 if i == 0 else 1.0) for i, r in enumerate(rewards)]
    + [_full(8, 0.5)],
  )
  s = learning.summarize(str(tmp_path), window=3)
  assert s["steps"] == 8 and s["window"] == 3 and s["reward_curve"] == rewards
  assert s["reward_first"] == pytest.approx(0.1) and s["reward_last"] == pytest.approx(0.6)
  assert s["reward_gain"] == pytest.approx(0.5)
  assert s["step_avg_s"] == 1.0  # the median: the compiling first step does not move it
  assert (s["eval_before"], s["eval_after"], s["eval_examples"]) == (0.2, 0.5, 100)
  se = math.hypot(math.sqrt(0.2 * 0.8 / 100), math.sqrt(0.5 * 0.5 / 100))
  assert s["eval_gain_se"] == pytest.approx(0.3 / se)
  # a window longer than half the run shrinks so first and last never overlap
  assert learning.summarize(str(tmp_path), window=10)["window"] == 4


def test_summarize_reads_the_agent_success_rate(tmp_path):
  """rl.agent's steps carry env/success_rate and no single-answer correctness: that is the curve (a
  summary that kept looking for reward/correct/mean would fail with a KeyError on agent runs)."""
  rows = [
    {"step": i + 1, "time/train/step_s": 1.0, learning.SUCCESS: r}
    for i, r in enumerate([0.0, 0.25, 0.5, 1.0])
  ]
  _write(tmp_path, [_full(0, 0.1)] + rows + [_full(4, 0.6)])
  s = learning.summarize(str(tmp_path), window=2)
  assert s["reward_key"] == learning.SUCCESS and s["reward_curve"] == [0.0, 0.25, 0.5, 1.0]
  assert s["reward_gain"] == pytest.approx(0.625)
  v = learning.verdict({0: s}, 0.25, 3.0)
  assert "success rate, first 2 steps" in learning.markdown("grid", {0: s}, v, (0.25, 3.0))


def test_summarize_without_a_baseline_eval(tmp_path):
  _write(tmp_path, [_step(1, 0.0), _step(2, 1.0), _full(2, 0.5)])
  s = learning.summarize(str(tmp_path))
  assert math.isnan(s["eval_before"]) and s["eval_after"] == 0.5 and s["reward_gain"] == 1.0


def test_verdict_needs_the_mean_reward_gain_and_every_seed_eval_rise():
  run = lambda gain, se: {
    "reward_gain": gain,
    "reward_first": 0.1,
    "reward_last": 0.1 + gain,
    "eval_before": 0.1,
    "eval_after": 0.3,
    "eval_gain_se": se,
  }
  assert learning.verdict({0: run(0.3, 4.0), 1: run(0.2, 3.5)}, 0.25, 3.0)["learns"]
  v = learning.verdict({0: run(0.3, 4.0), 1: run(0.1, 3.5)}, 0.25, 3.0)  # mean gain 0.2
  assert not v["reward_ok"] and v["eval_ok"] and not v["learns"]
  v = learning.verdict({0: run(0.3, 4.0), 1: run(0.3, 2.9)}, 0.25, 3.0)  # one seed short
  assert v["reward_ok"] and not v["eval_ok"] and v["eval_gain_se_min"] == 2.9


def test_learning_run_end_to_end(tmp_path):
  report = learning.main(
    [
      "--config",
      "configs/cpu-default.yaml",
      "--seeds",
      "3",
      "--out",
      str(tmp_path),
      *TINY,
      "train.steps=2",
      "train.warmup_sft_steps=0",
    ]
  )
  run = report["runs"][3]
  assert len(run["reward_curve"]) == 2 and run["eval_examples"] == 4
  assert not math.isnan(run["eval_before"])  # the baseline eval runs without an SFT warm-up too
  saved = json.loads((tmp_path / "learning.json").read_text())
  assert saved["runs"]["3"]["reward_curve"] == run["reward_curve"]
  assert "learns" in saved["verdict"]
  assert (tmp_path / "learning.md").read_text().startswith("| cpu-default.yaml: seed")
  assert (tmp_path / "reward_curve.png").stat().st_size > 0
