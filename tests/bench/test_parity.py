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


def test_wandb_summaries_table_with_deltas(tmp_path, capsys):
  """Two runs' wandb-summary.json: the seed runs' four figures side by side with B - A; B's summary
  predates the alias (our eval/accuracy only) and lacks the eval_full time."""
  a = {
    "eval_full/accuracy": 0.40,
    "eval/reward/func/reward_correct/mean": 0.50,
    "time/train/step_avg_last10_s": 2.0,
    "time/eval_full/step_s": 10.0,
  }
  b = {"eval_full/accuracy": 0.46, "eval/accuracy": 0.45, "time/train/step_avg_last10_s": 2.5}
  for name, summary in (("a", a), ("b", b)):
    (tmp_path / name).mkdir()
    (tmp_path / name / "wandb-summary.json").write_text(json.dumps(summary))
  cmp = parity.main(
    ["--wandb-summaries", str(tmp_path / "a"), str(tmp_path / "b/wandb-summary.json")]
  )
  rows = cmp["rows"]
  assert rows["eval_full/accuracy"]["delta"] == pytest.approx(0.06)
  assert rows["eval/reward/func/reward_correct/mean"]["b"] == 0.45  # read under our name
  assert rows["time/eval_full/step_s"]["delta"] is None
  out = capsys.readouterr().out
  assert "| eval_full accuracy | 0.4000 | 0.4600 | +0.0600 |" in out
  assert "| eval correct reward | 0.5000 | 0.4500 | -0.0500 |" in out
  assert "| step_avg_last10 (s) | 2.0000 | 2.5000 | +0.5000 (+25.0%) |" in out
  assert "| eval_full step time (s) | 10.0000 | missing | n/a |" in out
  with pytest.raises(ValueError, match=r"no wandb-summary\.json"):
    parity.main(["--wandb-summaries", str(tmp_path / "a"), str(tmp_path)])
  with pytest.raises(SystemExit):  # the arms' options are still required without it
    parity.main(["--seeds", "0", "1"])


def test_wandb_summaries_of_two_offline_runs(tmp_path, capsys):
  """The same table from two runs' out_dirs, read from their offline W&B logs."""
  pytest.importorskip("wandb")
  from rl.logging.metrics import MetricsWriter
  from rl.logging.wandb_config import WandbConfig
  from rl.logging.wandb_sink import open_sink

  for name, accuracy, step_s in (("a", 0.25, 3.0), ("b", 0.75, 2.0)):
    out = str(tmp_path / name)
    sink = open_sink(WandbConfig(project="grpo-kernels-tests", mode="offline"), out, {})
    writer = MetricsWriter(out, tensorboard=False, wandb=sink)
    writer.write(0, {"eval_full/accuracy": 0.1, "time/eval_full/step_s": 9.0})
    writer.write(1, {"eval/accuracy": accuracy, "time/train/step_avg_last10_s": step_s})
    writer.write(2, {"eval_full/accuracy": accuracy, "time/eval_full/step_s": 4.0})
    writer.close()
  cmp = parity.main(["--wandb-summaries", str(tmp_path / "a"), str(tmp_path / "b")])
  assert {k: r["delta"] for k, r in cmp["rows"].items()} == pytest.approx(
    {k: d for k, d in zip(cmp["rows"], (0.5, 0.5, -1.0, 0.0))}
  )
  assert "| step_avg_last10 (s) | 3.0000 | 2.0000 | -1.0000 (-33.3%) |" in capsys.readouterr().out


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
