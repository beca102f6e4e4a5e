"""``python -m bench.device``'s CPU path: the plan, step bookkeeping (ok / failed / timed out / skipped),
the results directory and the cache install. The full tiny run (every step at tiny sizes) takes minutes
on CPU and is what `python -m bench.device --size tiny` is for; here each piece is checked in seconds."""

import json
import sys

import pytest

from bench import device
from kernels import autotune


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
  out = tmp_path / "results"
  assert device.main(["--dry-run", "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  for step in device.STEPS:
    assert printed.count(f"\n{step} ") + printed.startswith(f"{step} ") == 1, printed
  assert "--size large" in printed and "-m gpu" in printed
  assert not out.exists()


def test_large_plan_fits_the_device_budget():
  """One device command is at most 10 minutes; the steps' limits leave 2 for start-up and copying."""
  steps = device.plan("large", device.ROOT / "x", None)
  assert [s.name for s in steps] == list(device.STEPS)
  assert sum(s.limit_s for s in steps) <= 8 * 60


def test_steps_record_ok_failure_timeout_and_skip(tmp_path):
  logs = tmp_path / "logs"
  logs.mkdir()
  py = sys.executable
  ok = device.run_step(device.Step("ok", [py, "-c", "print('hi')"], 30), logs)
  bad = device.run_step(device.Step("bad", [py, "-c", "raise SystemExit(3)"], 30), logs)
  slow = device.run_step(device.Step("slow", [py, "-c", "import time; time.sleep(30)"], 1), logs)
  skip = device.run_step(device.Step("skip", [py], 30, skip_reason="no data"), logs)
  assert (ok.returncode, bad.returncode, slow.returncode) == (0, 3, None)
  assert slow.timed_out and not ok.timed_out and slow.wall_s < 20
  assert skip.skipped == "no data" and skip.returncode is None
  assert "hi" in (logs / "ok.log").read_text()
  text = device.summary([ok, bad, slow, skip], dict(date="d", commit="c"))
  for status in ("| ok | ok |", "FAILED (rc 3)", "TIMED OUT", "skipped: no data"):
    assert status in text


def test_main_writes_results_dir_and_skips_parity_without_data(tmp_path):
  out = tmp_path / "run"
  rc = device.main(
    ["--size", "tiny", "--out", str(out), "--step", "env", "--step", "parity"]
    + ["--data", str(tmp_path / "no-gsm8k")]
  )
  assert rc == 0  # a skipped step is not a failure
  meta = json.loads((out / "device.json").read_text())
  steps = {s["name"]: s for s in meta["steps"]}
  assert steps["env"]["returncode"] == 0
  assert "no GSM8K" in steps["parity"]["skipped"]
  env = json.loads((out / "env.json").read_text())
  assert env["jax"] and env["devices"]
  assert meta["installed_cache"] == []  # no tune step ran
  assert (out / "summary.md").exists()


def test_install_cache_copies_tuned_files(tmp_path, monkeypatch):
  (tmp_path / "run" / "tuning").mkdir(parents=True)
  (tmp_path / "run" / "tuning" / "nvidia-h100.json").write_text("{}")
  monkeypatch.setattr(autotune, "TUNING_DIR", tmp_path / "kernels-tuning")
  copied = device.install_cache(tmp_path / "run")
  assert copied == [str(tmp_path / "kernels-tuning" / "nvidia-h100.json")]


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path):
  """Every step at tiny sizes (minutes on CPU): the bench, tuner and parity plumbing together."""
  assert device.main(["--size", "tiny", "--out", str(tmp_path / "run")]) == 0
