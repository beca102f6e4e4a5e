"""bench.parity: the paired interval and verdict, and one small end-to-end parity run."""

import json

import pytest

from bench import parity
from tests.rl.test_train import TINY

LOSS_ARMS = [
  "--arm",
  "xla: train.policy_loss_impl=xla",
  "--arm",
  "pallas: train.policy_loss_impl=pallas",
]


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
      *LOSS_ARMS,
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


def test_ppo_parity_arms_on_the_grid(tmp_path):
  """--agent: every arm is an rl.agent run (PPO with its value head on the frozen lake), summarised
  by its success rate; the two loss implementations must start from the same state (same seed), so
  their first steps' success rates agree exactly."""
  report = parity.main(
    [
      "--agent",
      "--config",
      "configs/cpu-grid.yaml",
      "--seeds",
      "0",
      "1",
      "--out",
      str(tmp_path),
      *LOSS_ARMS,
      "model.preset=tiny",
      "rollout.max_seq_len=256",
      "rollout.max_slots=16",
      "sampling.group_size=2",
      "train.prompts_per_step=2",
      "train.micro_batch_size=4",
      "env.max_turns=2",
      "eval.batch=2",
      "train.steps=2",
      "train.warmup_sft_steps=0",
      "run.progress=false",
      "run.tensorboard=false",
    ]
  )
  assert report["entry"] == "rl.agent"
  runs = report["runs"]
  assert runs["xla"][0]["reward_key"] == "env/success_rate"
  for seed in (0, 1):
    assert runs["xla"][seed]["reward_curve"][0] == runs["pallas"][seed]["reward_curve"][0]
    assert runs["pallas"][seed]["eval_examples"] == 2
  assert "success rate first -> last" in (tmp_path / "parity.md").read_text()
