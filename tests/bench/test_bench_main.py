"""`python -m bench` end to end at the harness's tiny size: one report directory with every field the
README promises, the plots, a failed row for a wrong kernel, and a readable profile."""

import dataclasses
import json
import pathlib

import pytest

from bench import __main__ as bench_main
from bench import report, run
from bench.cases import all_cases
from bench.roofline import DevicePeaks


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
  out = tmp_path_factory.mktemp("report")
  rc = bench_main.main(
    [
      "--size",
      "tiny",
      "--suite",
      "grpo_loss",
      "--suite",
      "optim",
      "--suite",
      "rollout",
      "--repeats",
      "2",
      "--warmup",
      "1",
      "--rollout-repeats",
      "1",
      "--out",
      str(out / "r"),
      "--profile",
      str(out / "prof"),
    ]
  )
  return rc, out


def test_report_has_every_field_and_figure(tiny_report):
  rc, out = tiny_report
  assert rc == 0
  payload = json.loads((out / "r" / "results.json").read_text())
  env = payload["environment"]
  for key in (
    "date",
    "device_kind",
    "jax",
    "git_commit",
    "interpret_mode",
    "peaks",
    "sizes",
    "profile",
  ):
    assert key in env, key
  names = {c["name"] for c in payload["cases"]}
  assert {"grpo_loss/tiny/fwd", "grpo_loss/tiny/fwd+bwd"} <= names and any(
    n.startswith("optim/") for n in names
  )
  for c in payload["cases"]:
    assert c["ok"] and c["parity"] and max(c["parity"].values()) <= 1.0
    for side in ("kernel", "reference"):
      t = c[side]["timing"]
      assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"] and t["iqr_s"] >= 0 and t["repeats"] == 2
      assert "temp_bytes" in c[side]["memory"] and "roofline_fraction" in c[side]
  (roll,) = payload["rollout"]
  assert {r["backend"] for r in roll["rows"]} == {"paged", "dense"} and all(
    r["ok"] for r in roll["rows"]
  )
  summary = (out / "r" / "summary.md").read_text()
  assert "grpo_loss/tiny/fwd" in summary and "Rollout engines" in summary
  for fig in ("roofline.png", "time_vs_size.png", "rollout.png"):
    assert (out / "r" / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({fig})" in summary


def test_profile_names_every_timed_case(tiny_report):
  pytest.importorskip("xprof")
  from bench import trace

  _, out = tiny_report
  s = trace.summarize(str(out / "prof"))
  assert {"bench/grpo_loss/tiny/fwd/kernel", "bench/grpo_loss/tiny/fwd/reference"} <= set(
    s["phases_us"]
  )


def test_wrong_kernel_is_a_failed_row_however_fast(tmp_path):
  case = next(c for c in all_cases("tiny", "cpu", ("grpo_loss",)) if c.mode == "fwd")
  wrong = dataclasses.replace(case, kernel=lambda *a: [x * 1.01 for x in case.reference(*a)])
  result = run.run_case(wrong, DevicePeaks(None, None, "none"), repeats=1, warmup=0)
  assert not result.ok and max(result.parity.values()) > 1.0
  assert "| no |" not in report.markdown_table([result]) and "| NO |" in report.markdown_table(
    [result]
  )


def test_bad_options_are_clear_errors():
  with pytest.raises(SystemExit):
    bench_main.parse_args(["--size", "huge"])
  with pytest.raises(ValueError, match="repeats"):
    bench_main.BenchConfig(repeats=0)


def test_bad_values_on_the_command_line_are_one_line_and_exit_2(capsys):
  with pytest.raises(SystemExit) as exc:
    bench_main.parse_args(["--repeats", "0"])
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert "repeats and rollout_repeats must be >= 1" in err and "Traceback" not in err


def test_device_kind_names_the_results_folder():
  assert bench_main.device_slug("cpu") == "cpu"
  assert bench_main.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
  assert bench_main.device_slug("TPU v5 lite") == "tpu-v5-lite"


def test_a_committed_report_re_renders_from_its_results_json(tmp_path):
  """`python -m bench.report DIR`: summary.md and figures from results.json alone, a failed case
  (no timings) listed as failed and left out of the figures instead of breaking them."""
  src = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results" / "example-cpu"
  payload = json.loads((src / "results.json").read_text())
  broken = dict(payload["cases"][0], name="grpo_loss/broken/fwd", kernel=None, reference=None)
  payload["cases"].append(dict(broken, ok=False, speedup=None, error="ValueError: boom"))
  row = dict(config="configs/cpu-default.yaml", timed_steps=10, device_kind="cpu", step_s=1.5)
  row.update(step_s_min=1.2, step_s_max=2.0, rollout_s=0.7, update_s=0.6, date="d")
  previous = dict(row, step_s=1.0, commit="0123456789abcdef")
  payload["environment"]["loop"] = {
    "row": row,
    "comparison": {"previous": previous, "ratio": 1.5, "verdict": "regression"},
  }
  (tmp_path / "results.json").write_text(json.dumps(payload))
  assert report.main([str(tmp_path)]) == 0
  summary = (tmp_path / "summary.md").read_text()
  assert "| grpo_loss/broken/fwd | failed: ValueError: boom |" in summary
  assert "| fused_linear | cpu-mid | N = 8 x 256 = 2048 tokens, vocabulary V = 16000" in summary
  assert "## GRPO loop step time" in summary
  assert "median 1.500 s [1.200, 2.000]" in summary and "1.50x the previous row" in summary
  assert "commit 0123456789, d): regression" in summary
  for fig in ("roofline.png", "time_vs_size.png", "rollout.png"):
    assert (tmp_path / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({fig})" in summary
  with pytest.raises(SystemExit):
    report.main([str(tmp_path / "missing")])
