"""bench.parity: the paired interval and verdict, and one small end-to-end parity run."""

import json

import pytest

from bench import parity
from tests.rl.test_train import TINY


def test_paired_interval_by_hand():
  # diffs 1, 2, 3: mean 2, sd 1, t(2) = 4.303 -> half-width 4.303 / sqrt(3)
  mean, _low, high = parity.paired_interval([1.0, 2.0, 3.0])
  assert mean == 2.0 and high - mean == pytest.approx(4.303 / 3**0.5)
  with pytest.raises(ValueError):
    parity.paired_interval([1.0])


@pytest.mark.parametrize(
  "low,high,margin,expected",
  [(-0.01, 0.02, 0.05, "parity"), (0.01, 0.02, 0.05, "differs"), (-0.2, 0.1, 0.05, "inconclusive")],
)
def test_verdict(low, high, margin, expected):
  assert parity.verdict(low, high, margin).startswith(expected)


def test_one_seed_is_refused(tmp_path):
  with pytest.raises(SystemExit, match="two seeds"):
    parity.main(
      ["--config", "configs/cpu-default.yaml", "--seeds", "0", "--arm", "a:", "--arm", "b:"]
    )


def test_parity_run_end_to_end(tmp_path):
  report = parity.main(
    [
      "--config",
      "configs/cpu-default.yaml",
      "--seeds",
      "0",
      "1",
      "--out",
      str(tmp_path),
      "--arm",
      "xla: train.policy_loss_impl=xla",
      "--arm",
      "pallas: train.policy_loss_impl=pallas",
      *TINY,
      "train.steps=2",
      "train.warmup_sft_steps=0",
      "data.synthetic_test=4",
    ]
  )
  assert len(report["runs"]["pallas"][1]["reward_curve"]) == 2
  cmp = report["comparisons"]["pallas - xla"]
  assert set(cmp) == {"eval_full_accuracy", "step_avg_s"}
  saved = json.loads((tmp_path / "parity.json").read_text())
  assert saved["runs"]["xla"]["0"]["reward_curve"] == report["runs"]["xla"][0]["reward_curve"]
  assert (tmp_path / "parity.md").exists()
