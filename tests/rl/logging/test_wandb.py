"""run.wandb: the W&B sink in offline mode (no network, no key), read back from wandb's own files: the
same rows as metrics.jsonl, the run's config, the seed runs' verdict keys in the summary, resume."""

import glob
import json
import os
import sys
import time

import pytest

from rl import cli, train
from rl.configlib import ConfigError
from rl.logging.metrics import MetricsWriter, read_metrics
from rl.logging.wandb_config import WandbConfig
from rl.logging.wandb_sink import ALIASES, STATE, VERDICT_KEYS, open_sink
from rl.logging.wandb_summary import read_summary, records
from tests.rl.test_train import TINY

OFFLINE = WandbConfig(project="grpo-kernels-tests", mode="offline")
# rows as rl.run.loop writes them: the warm-up's, eval_full before GRPO (step 0), GRPO steps
SFT = [{"sft/loss": 2.5, "sft/grad_norm": 1.5, "sft/nonfinite_steps": 0.0}]
BASELINE = {"eval_full/accuracy": 0.25, "eval_full/format": 0.9, "time/eval_full/step_s": 3.0}


def _step(step: int) -> dict[str, float]:
  row = {"reward/total/mean": 0.1 * step, "train/loss": 1.0 / step, "time/train/step_s": 2.0}
  row |= {"time/train/step_avg_last10_s": 2.0 + step / 10, "eval/accuracy": 0.2 * step}
  return row | {"eval/format": 0.5, "eval/reward/total/mean": 0.2 * step + 0.05}


def _write(writer: MetricsWriter, steps) -> None:
  for step in steps:
    row = _step(step)
    if step == 3:  # the run's last step: eval_full after GRPO
      row |= {"eval_full/accuracy": 0.75, "eval_full/format": 1.0, "time/eval_full/step_s": 2.5}
    writer.write(step, row)


def _offline_runs(run_dir) -> list[str]:
  return sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")))


def _parsed(run):
  from wandb.proto import wandb_internal_pb2 as pb

  for path in glob.glob(os.path.join(run, "run-*.wandb")):
    for data in records(path):
      record = pb.Record()
      record.ParseFromString(data)
      yield record


def _history(run) -> list[dict]:
  """The rows W&B recorded for one offline run, W&B's own `_*` keys left out."""
  rows = []
  for record in _parsed(run):
    if record.WhichOneof("record_type") == "history":
      items = {
        i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
      }
      rows.append({k: v for k, v in items.items() if not k.startswith("_")})
  return rows


def _config(run) -> dict:
  for record in _parsed(run):
    if record.WhichOneof("record_type") == "run":
      return {i.key: json.loads(i.value_json) for i in record.run.config.update}
  raise AssertionError(f"{run}: no run record")


def test_the_config_key_is_off_by_default_and_bad_values_name_it(tmp_path, monkeypatch):
  cfg = cli.parse_args(TINY)
  assert cfg.run.wandb == WandbConfig() and cfg.run.wandb.mode == "disabled"
  assert open_sink(cfg.run.wandb, str(tmp_path), {}) is None  # disabled: wandb never imported
  with pytest.raises(ConfigError, match=r"run\.wandb\.mode must be one of .*'cloud'"):
    cli.parse_args([*TINY, "run.wandb.mode=cloud"])
  with pytest.raises(ConfigError, match=r"run\.wandb\.project must be a non-empty string"):
    cli.parse_args([*TINY, "run.wandb.mode=offline", "run.wandb.project=' '"])
  monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
  with pytest.raises(ConfigError, match=r'run\.wandb\.mode=offline .*"grpo-kernels\[wandb\]"'):
    open_sink(OFFLINE, str(tmp_path), {})


def test_offline_sink_has_the_jsonl_rows_the_config_and_the_verdict_summary(tmp_path):
  pytest.importorskip("wandb")
  config = {"train": {"steps": 3, "learning_rate": 1e-3}, "run": {"out_dir": str(tmp_path)}}
  writer = MetricsWriter(
    str(tmp_path), tensorboard=False, wandb=open_sink(OFFLINE, str(tmp_path), config)
  )
  for i, row in enumerate(SFT):
    writer.write(i + 1, row)
  writer.write(0, BASELINE)
  _write(writer, [1, 2, 3])
  writer.close()
  (run,) = _offline_runs(tmp_path)
  jsonl, history = read_metrics(str(tmp_path)), _history(run)
  assert len(history) == len(jsonl) == len(SFT) + 4
  for line, row in zip(jsonl, history):  # every row, every key, in order; aliases beside ours
    axis = "sft/step" if "sft/loss" in line else "step"
    assert row.pop(axis) == line.pop("step")
    assert row == {**line, **{ALIASES[k]: v for k, v in line.items() if k in ALIASES}}
  assert _config(run)["train"] == config["train"]
  summary = read_summary(str(tmp_path))
  assert {k: summary[k] for k in VERDICT_KEYS} == {
    "eval_full/accuracy": 0.75,  # after GRPO, not the step-0 baseline
    "eval/reward/func/reward_correct/mean": _step(3)["eval/accuracy"],
    "eval/reward/total/mean": _step(3)["eval/reward/total/mean"],
    "time/train/step_avg_last10_s": _step(3)["time/train/step_avg_last10_s"],
    "time/eval_full/step_s": 2.5,
  }
  assert read_summary(run) == summary  # the run directory itself reads the same


def test_a_run_without_eval_full_after_grpo_reports_no_eval_full_verdict(tmp_path):
  """The step-0 row's eval_full is the policy before GRPO: never the run's result in the summary."""
  pytest.importorskip("wandb")
  writer = MetricsWriter(
    str(tmp_path), tensorboard=False, wandb=open_sink(OFFLINE, str(tmp_path), {})
  )
  writer.write(0, BASELINE)
  _write(writer, [1, 2])  # eval.full_at_end=false: no eval_full after GRPO
  writer.close()
  summary = read_summary(str(tmp_path))
  assert "eval_full/accuracy" not in summary and "time/eval_full/step_s" not in summary
  assert summary["eval/reward/func/reward_correct/mean"] == _step(2)["eval/accuracy"]


def test_a_resumed_run_continues_the_same_wandb_run_and_logs_each_step_once(tmp_path):
  pytest.importorskip("wandb")

  def writer():
    return MetricsWriter(
      str(tmp_path), tensorboard=False, wandb=open_sink(OFFLINE, str(tmp_path), {})
    )

  first = writer()
  _write(first, [1, 2, 3])  # killed after step 3, its newest checkpoint at step 2
  first.close()
  time.sleep(1.1)  # offline run directories are named to the second
  resumed = writer()
  assert resumed.rewind(2) == [3]  # the jsonl drops step 3; W&B already has it
  _write(resumed, [3, 4])
  resumed.close()
  runs = _offline_runs(tmp_path)
  assert len(runs) == 2 and len({r.rsplit("-", 1)[1] for r in runs}) == 1  # one W&B run id
  assert [row["step"] for row in _history(runs[0])] == [1, 2, 3]
  assert [row["step"] for row in _history(runs[1])] == [4]
  assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2, 3, 4]
  assert read_summary(str(tmp_path))["step"] == 4  # the segments read in order
  time.sleep(1.1)
  fresh = writer()  # --resume with no checkpoint: a fresh start, a new W&B run
  fresh.rewind(0)
  _write(fresh, [1])
  fresh.close()
  with open(tmp_path / STATE) as f:
    assert json.load(f) == {"id": _offline_runs(tmp_path)[-1].rsplit("-", 1)[1], "last_step": 1}
  with pytest.raises(ValueError, match="several W&B runs"):
    read_summary(str(tmp_path))


def test_only_process_0_writes(tmp_path):
  pytest.importorskip("wandb")
  writer = MetricsWriter(str(tmp_path), enabled=False, wandb=open_sink(OFFLINE, str(tmp_path), {}))
  _write(writer, [1])
  writer.close()
  assert not os.path.exists(tmp_path / "wandb")


def test_a_tiny_loop_in_offline_mode(tmp_path):
  """rl.train with run.wandb.mode=offline: W&B has every metrics.jsonl row, the run's config and,
  in its summary, the verdict keys the run produced; eval/reward/total/mean is the weighted sum."""
  pytest.importorskip("wandb")
  out = tmp_path / "run"
  metrics = train.main(
    [*TINY, f"run.out_dir={out}", "train.steps=2", "eval.every=1", "run.tensorboard=false"]
    + ["run.wandb.mode=offline", "run.wandb.project=grpo-kernels-tests", "run.wandb.name=tiny"]
  )
  (run,) = _offline_runs(out)
  jsonl, history = read_metrics(str(out)), _history(run)
  assert [r.get("step", r.get("sft/step")) for r in history] == [m["step"] for m in jsonl]
  for line, row in zip(jsonl, history):
    assert all(row[k] == pytest.approx(v) for k, v in line.items() if k != "step")
  assert _config(run)["train"]["steps"] == 2 and _config(run)["run"]["wandb"]["mode"] == "offline"
  last = jsonl[-1]
  total = last["eval/accuracy"] * 1.0 + last["eval/format"] * 0.1  # reward.correct, reward.format
  assert last["eval/reward/total/mean"] == pytest.approx(total)
  summary = read_summary(str(out))
  assert summary["eval_full/accuracy"] == pytest.approx(metrics["eval_full/accuracy"])
  assert summary["eval/reward/func/reward_correct/mean"] == pytest.approx(last["eval/accuracy"])
  assert summary["eval/reward/total/mean"] == pytest.approx(total)
  assert summary["time/eval_full/step_s"] == pytest.approx(last["time/eval_full/step_s"])
