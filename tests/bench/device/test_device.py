"""``python -m bench.device``'s calls on CPU: the plans and their budgets, step bookkeeping (ok / failed /
stopped at its limit / skipped), a stopped step keeping its rows, the launcher's jax options, and one
call rehearsed end to end at tiny size (every call end to end is the slow test)."""

import json
import sys
import tarfile

import jax
import pytest

from bench.device import __main__ as device
from bench.device import plan as device_plan


@pytest.mark.parametrize("call", device_plan.CALLS)
def test_dry_run_prints_each_calls_plan_and_writes_nothing(tmp_path, capsys, call):
  out = tmp_path / "results"
  argv = ["--call", call, "--dry-run", "--out", str(out), "--work", str(tmp_path / "w")]
  assert device.main(argv) == 0
  printed = capsys.readouterr().out
  for step in device_plan.LARGE_LIMITS[call]:
    assert f"\n{step} " in "\n" + printed, (step, printed)
  assert f"call budget {device_plan.CALL_BUDGET_S} s" in printed
  assert not out.exists()


def test_large_plans_fit_the_call_budget_and_cover_everything(tmp_path):
  """Catches a call that cannot finish in a 10-minute device command (the first plan's steps were
  killed at 60 / 100 / 150 s) or one that silently drops a suite, an op, or the loop's overrides."""
  for call in device_plan.CALLS:
    steps = device_plan.plan(call, "large", tmp_path, tmp_path)
    assert sum(s.limit_s for s in steps) <= device_plan.CALL_BUDGET_S, call
  kernels = {s.name: s for s in device_plan.plan("kernels", "large", tmp_path)}
  assert set(device_plan.KERNEL_SUITES) | {"gpu-tests", "peers"} <= set(kernels)
  assert kernels["peers"].memory_fraction == device_plan.PEERS_JAX_MEMORY_FRACTION
  assert all("--size large" in " ".join(kernels[s].argv) for s in device_plan.KERNEL_SUITES)
  tune = device_plan.plan("tune", "large", tmp_path)
  assert {s.name for s in tune} - {"env"} == set(device_plan.TUNE_OPS)
  for s in tune[1:]:  # the op's budget leaves the step time to start and set up
    assert float(s.argv[s.argv.index("--budget-s") + 1]) < s.limit_s
  loop = {s.name: s for s in device_plan.plan("loop", "large", tmp_path, tmp_path)}
  parity = " ".join(loop["parity"].argv)
  assert "--seeds 0 1" in parity and "rollout.max_seq_len=1280" in parity
  assert (
    "xla: train.policy_loss_impl=xla" in parity
    and "pallas: train.policy_loss_impl=pallas" in parity
  )
  assert "run.profile_steps=2" in loop["profile"].argv
  assert "no GSM8K" in loop["parity"].skip_reason  # tmp_path holds no train.jsonl
  with pytest.raises(ValueError, match="unknown step"):
    device_plan.plan("tune", "large", tmp_path, limits={"bench": 5})


def test_steps_record_ok_failure_timeout_and_skip(tmp_path):
  py = sys.executable
  step = lambda name, code, limit, **kw: device_plan.Step(
    name, [py, "-c", code], limit, jax=False, **kw
  )
  ok = device.run_step(step("ok", "print('hi')", 30), tmp_path, None)
  bad = device.run_step(step("bad", "raise SystemExit(3)", 30), tmp_path, None)
  slow = device.run_step(step("slow", "import time; time.sleep(30)", 1), tmp_path, None)
  skip = device.run_step(step("skip", "", 30, skip_reason="no data"), tmp_path, None)
  assert (ok.returncode, bad.returncode, slow.returncode) == (0, 3, None)
  assert slow.timed_out and not ok.timed_out and slow.wall_s < 20
  assert skip.skipped == "no data" and skip.returncode is None
  assert "hi" in (tmp_path / "logs" / "ok.log").read_text()
  text = device.summary([ok, bad, slow, skip], dict(call="x", date="d", commit="c"))
  for status in ("| ok | ok |", "FAILED (rc 3)", "STOPPED at its limit", "skipped: no data"):
    assert status in text


_PARTIAL_STEP = """
import pathlib, sys, time
from bench import report
from bench.kernels.run import CaseResult
# a finished row (an error row: the plumbing, not a kernel, is under test here), then a hang
r = CaseResult("optim/done/step", "optim", "done", "step", {}, None, None, None, None, {}, False, None,
               error="ValueError: the row this step finished")
out = pathlib.Path(sys.argv[1])
report.write(out, dict(date="d", device_kind="cpu", device_platform="cpu", jax="j", git_commit="c",
             interpret_mode=True, peaks=dict(source="none")), [r], plots=False,
             remaining=["optim/never/step"])
print("[case]", r.name, flush=True)
time.sleep(120)
"""


def test_a_step_stopped_by_its_limit_keeps_its_rows_in_three_files(tmp_path, capsys):
  """Catches the first H100 run's loss (12 measured cases gone when the bench step hit its limit):
  the step writes one row, then hangs past its limit; the call's archive still holds that row, the
  summary shows it stopped and what it kept, and ``--out`` holds exactly three files (a device
  command returns at most 8, two folders deep)."""
  work, out = tmp_path / "work", tmp_path / "out"
  code = [sys.executable, "-c", _PARTIAL_STEP, str(work / "suite")]
  steps = [device_plan.Step("suite", code, 12, jax=False, results="suite")]
  meta = dict(call="kernels", slug="cpu", date="d", commit="c", device="cpu", jax=jax.__version__)
  assert device.run_call("kernels", steps, out, work, meta) == 1
  assert sorted(p.name for p in out.iterdir()) == [
    "kernels-cpu.tar.gz",
    "kernels.json",
    "summary.md",
  ]
  with tarfile.open(out / "kernels-cpu.tar.gz") as tar:
    names = tar.getnames()
    payload = json.load(tar.extractfile("kernels-cpu/suite/results.json"))
  assert "kernels-cpu/logs/suite.log" in names
  assert len(payload["cases"]) == 1 and payload["partial"]["remaining"] == ["optim/never/step"]
  summary = (out / "summary.md").read_text()
  assert "| suite | STOPPED at its limit |" in summary and "1 cases (PARTIAL: 1 not run)" in summary
  assert payload["cases"][0]["name"] in summary
  printed = capsys.readouterr().out
  assert "[suite] [case]" in printed  # echoed while it ran
  assert printed.rstrip().endswith(summary.rstrip().splitlines()[-1])  # the summary comes last
  steps_json = json.loads((out / "kernels.json").read_text())["steps"]
  assert steps_json[0]["timed_out"] and steps_json[0]["limit_s"] == 12


def test_the_launcher_sets_the_calls_jax_options_through_jax_config(tmp_path, monkeypatch):
  """Catches options that never reach the step (the compilation cache shared by a call's steps, the
  memory fraction that lets torch share the GPU): set via jax.config, then the module runs."""
  import runpy

  ran = []
  monkeypatch.setattr(runpy, "run_module", lambda name, **kw: ran.append((name, list(sys.argv))))
  monkeypatch.setattr(sys, "argv", list(sys.argv))
  before = (jax.config.jax_compilation_cache_dir, jax.config.jax_pjrt_client_create_options)
  try:
    argv = ["exec", "--compilation-cache", str(tmp_path), "--memory-fraction", "0.5"]
    device.main([*argv, "--", "-m", "bench.tune", "--size", "tiny"])
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    assert jax.config.jax_pjrt_client_create_options == {
      "preallocate": False,
      "memory_fraction": 0.5,
    }
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_pjrt_client_create_options", before[1])
  assert ran == [("bench.tune", ["bench.tune", "--size", "tiny"])]
  with pytest.raises(SystemExit):
    device.main(["exec", "--memory-fraction", "2", "--", "-m", "bench.tune"])


def test_tune_call_rehearsed_on_cpu(tmp_path, capsys):
  """``--call tune --size tiny`` (two of its steps) end to end: real subprocesses through the
  launcher, the op's cache in the archive, the summary's winner table printed last."""
  out = tmp_path / "out"
  argv = ["--call", "tune", "--size", "tiny", "--step", "env", "--step", "paged_attention"]
  assert device.main([*argv, "--out", str(out)]) == 0
  assert sorted(p.name for p in out.iterdir()) == ["summary.md", "tune-cpu.tar.gz", "tune.json"]
  with tarfile.open(out / "tune-cpu.tar.gz") as tar:
    cache = json.load(tar.extractfile("tune-cpu/tuning/cpu.json"))
  assert cache["entries"]["paged_attention"]
  printed = capsys.readouterr().out
  assert "| paged_attention | ok |" in printed and "| bucket | heuristic ms | winner |" in printed
  assert " heuristic: " in printed  # the tuner's per-candidate lines, echoed live


@pytest.mark.slow
@pytest.mark.parametrize("call", device_plan.CALLS)
def test_every_call_end_to_end_at_tiny_size(tmp_path, call):
  """Each call's whole plan on CPU (minutes each): kernels incl. the peers' skipped rows, every tuner
  op, the loop's rollout suite, 2-seed parity, profile and trace summary."""
  out = tmp_path / "out"
  assert device.main(["--call", call, "--size", "tiny", "--out", str(out)]) == 0
  assert len(list(out.iterdir())) == 3
  summary = (out / "summary.md").read_text()
  assert "STOPPED" not in summary and "FAILED" not in summary
  if call == "loop":
    assert "top ops" in summary


def test_the_archive_leaves_out_caches_checkpoints_and_oversized_files(tmp_path, monkeypatch):
  """Catches an archive over the 16 MiB a returned file may have (a CPU loop rehearsal's was 31 MB:
  its runs' final checkpoints): re-creatable bulk is skipped, oversized files are listed instead."""
  work = tmp_path / "work"
  for rel, size in [
    ("logs/a.log", 10),
    ("jax-cache/x", 10),
    ("parity/xla/seed0/checkpoints/2/d", 10),
    ("profile/p/jit_step.hlo_proto.pb", 10),
    ("profile/p/vm.xplane.pb", 300),
  ]:
    (work / rel).parent.mkdir(parents=True, exist_ok=True)
    (work / rel).write_bytes(b"x" * size)
  monkeypatch.setattr(device, "BIG_FILE", 100)
  left = device.write_archive(work, tmp_path / "loop-cpu.tar.gz")
  with tarfile.open(tmp_path / "loop-cpu.tar.gz") as tar:
    assert tar.getnames() == ["loop-cpu/logs/a.log"]
  assert left == ["profile/p/vm.xplane.pb (0.0 MiB)"]


def test_install_cache_copies_tuned_files(tmp_path, monkeypatch):
  from kernels import autotune

  (tmp_path / "work" / "tuning").mkdir(parents=True)
  (tmp_path / "work" / "tuning" / "nvidia-h100.json").write_text("{}")
  monkeypatch.setattr(autotune, "TUNING_DIR", tmp_path / "kernels-tuning")
  assert device.install_cache(tmp_path / "work") == [
    str(tmp_path / "kernels-tuning" / "nvidia-h100.json")
  ]
