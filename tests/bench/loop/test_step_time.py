"""bench.loop.step_time: the step-time history (comparison by hand, a corrupt row named) and one tiny run that
appends to it and is compared with the row before."""

import json

import pytest

from bench.loop import step_time as loop
from tests.rl.test_train import TINY

KEYS = dict(
  device_kind="cpu",
  jax="0.10.2",
  config="c.yaml",
  config_digest="d1",
  overrides=[],
  steps=12,
  skip=2,
)


def _row(step_s, **changes):
  return {**KEYS, "step_s": step_s, "date": "d", "commit": "abc", **changes}


def test_compare_with_the_last_row_of_the_same_key():
  history = [_row(1.0), _row(2.0), _row(0.1, device_kind="gpu"), _row(0.1, overrides=["x=1"])]
  cmp = loop.compare(_row(2.4), history, tolerance=0.25)
  assert cmp["previous"]["step_s"] == 2.0 and cmp["ratio"] == pytest.approx(1.2)
  assert cmp["verdict"] == "ok"
  assert loop.compare(_row(2.6), history, 0.25)["verdict"] == "regression"
  assert loop.compare(_row(1.4), history, 0.25)["verdict"] == "faster"
  first = loop.compare(_row(1.0, jax="0.11.2"), history, 0.25)  # another jax: nothing to compare
  assert first["previous"] is None and first["verdict"].startswith("first row")
  # the same file with other contents (a new default) is a new series, not a 10x regression
  changed = loop.compare(_row(20.0, config_digest="d2"), history, 0.25)
  assert changed["previous"] is None


def test_config_digest_follows_the_resolved_config_not_the_path():
  base = loop.config_digest("configs/cpu-default.yaml")
  assert base == loop.config_digest("configs/cpu-default.yaml", ["run.out_dir=/elsewhere"])
  assert base != loop.config_digest("configs/cpu-default.yaml", ["train.ppo_epochs=3"])


def test_history_file(tmp_path):
  path = tmp_path / "h.jsonl"
  assert loop.read_history(path) == []
  loop.append(_row(1.0), path)
  loop.append(_row(2.0), path)
  assert [r["step_s"] for r in loop.read_history(path)] == [1.0, 2.0]
  path.write_text(path.read_text() + "{not json\n")
  with pytest.raises(ValueError, match=r"h\.jsonl:3: not a JSON row"):
    loop.read_history(path)


def test_steps_must_exceed_the_compiling_ones():
  with pytest.raises(ValueError, match=r"steps \(3\) must exceed skip \(3\)"):
    loop.measure("configs/cpu-default.yaml", 3, 3)


def test_loop_run_appends_and_compares(tmp_path, capsys):
  history = tmp_path / "loop.jsonl"
  args = ["--config", "configs/cpu-default.yaml", "--steps", "3", "--skip", "1"]
  args += ["--history", str(history), "--fail-on-regression", *TINY]
  assert loop.main(args) == 0
  (row,) = loop.read_history(history)
  # steady steps only: a step that compiled (the rollout's prefill may, in step 2) is left out
  assert row["timed_steps"] >= 1 and row["timed_steps"] + row["compile_steps"] == 2
  assert row["steps"] == 3 and row["overrides"] == TINY
  assert row["step_s_min"] <= row["step_s"] <= row["step_s_max"] and row["update_s"] > 0
  assert "first row" in capsys.readouterr().out
  # a previous row 100x faster: this run is a regression, and the command says so with status 1
  history.write_text(json.dumps(dict(row, step_s=row["step_s"] / 100)) + "\n")
  assert loop.main(args) == 1
  assert "regression" in capsys.readouterr().out
  assert len(loop.read_history(history)) == 2
