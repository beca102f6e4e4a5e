"""`python -m bench` end to end at the harness's tiny size: one report directory with every field the
manual promises (docs/benchmarks.md), the plots, a failed row for a wrong kernel, and a readable profile."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import report
from bench.kernels import run
from bench.kernels.cases import all_cases
from bench.kernels.roofline import DevicePeaks

# The module fixture runs the tiny bench (grpo_loss, one AdamW optim case, rollout, profiled). AdamW's
# second case (the optax-API one) added no field or figure but a third of the run's CPU time (the
# command: 81 s of CPU instead of 120 s; 153 s instead of 242 s of wall on the shared machine under
# load); the whole fixture took 290 s of CI's wall time with it, 440 s once with all six optim cases.
pytestmark = pytest.mark.timeout(1200)


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
      "--case",
      "grpo_loss/*",
      "--case",
      "optim/adamw-inplace/*",  # an optimizer row (donated inputs): the report's optim fields
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


def test_case_globs_pick_the_timed_cases_and_name_one_that_matches_nothing(capsys):
  """`--case`: only the kernel cases whose name matches a glob are timed, and a glob matching none
  of the chosen suites' cases stops the run before anything compiles, naming the glob (exit 2).
  Catches a typo'd glob silently timing nothing, or every case."""
  cases = all_cases("tiny", "cpu", ("grpo_loss", "optim"))
  picked = bench_main.chosen(cases, ("optim/adamw-*", "grpo_loss/tiny/fwd"))
  assert [c.name for c in picked] == [
    "grpo_loss/tiny/fwd",
    "optim/adamw-inplace/tiny/step",
    "optim/adamw-optax-api/tiny/step",
  ]
  assert bench_main.chosen(cases, None) == cases
  rc = bench_main.main(["--size", "tiny", "--suite", "optim", "--case", "optim/adam-*"])
  assert rc == 2 and "'optim/adam-*' matches no kernel case" in capsys.readouterr().err


def test_wrong_kernel_is_a_failed_row_however_fast(tmp_path):
  case = next(c for c in all_cases("tiny", "cpu", ("grpo_loss",)) if c.mode == "fwd")
  wrong = dataclasses.replace(case, kernel=lambda *a: [x * 1.01 for x in case.reference(*a)])
  result = run.run_case(wrong, DevicePeaks(None, None, "none"), repeats=1, warmup=0)
  assert not result.ok and max(result.parity.values()) > 1.0
  assert "| no |" not in report.markdown_table([result]) and "| NO |" in report.markdown_table(
    [result]
  )


def test_a_donated_case_gets_fresh_inputs_for_every_call_and_parity(tmp_path):
  """Optimizer cases donate params and state (in place: 7 words per AdamW parameter instead of 13).
  A donated input is consumed by its call, so a harness that re-used the case's inputs for the next
  warm-up / timed call or for the reference would fail with a deleted buffer (or, where the backend
  ignores donation, time and compare the wrong step). Here every call must see the seed's own input:
  the kernel counts its calls into a consumed buffer, and parity still holds."""
  from bench.kernels.cases import Case, Check

  made = []

  def make_inputs(seed):
    made.append(seed)
    return (jnp.arange(8.0) + seed, jnp.ones(8))

  step = lambda x, g: (x - 0.5 * g, g * 2.0)
  case = Case(
    "donated",
    "tiny",
    "step",
    make_inputs,
    step,
    lambda x, g: (x - g / 2.0, g + g),
    None,
    None,
    (Check((0, 1), "optimizer", "float32", 1, "out"),),
    donate_argnums=(0,),
  )
  result = run.run_case(case, DevicePeaks(None, None, "none"), repeats=3, warmup=1)
  assert result.error is None and result.ok, result
  # 1 abstract trace + per side: 1 warm-up + 3 timed + 1 parity call, each on fresh inputs
  assert len(made) >= 2 * (1 + 3 + 1)
  wrong = dataclasses.replace(case, kernel=lambda x, g: (x - 0.6 * g, g * 2.0))
  assert not run.run_case(wrong, DevicePeaks(None, None, "none"), repeats=1, warmup=0).ok


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


# ------------------------------------------------------------------- results survive any stop
def test_a_run_stopped_after_two_cases_keeps_them_and_says_what_is_left(tmp_path, monkeypatch):
  """Catches a report written only at the end (the first H100 run lost 12 measured cases so): the
  third case is interrupted as a time limit would; results.json must hold the two finished rows and
  name the cases still to run, and summary.md must say the report is partial."""
  calls = []

  def stop_on_third(case, *a, **kw):
    calls.append(case.name)
    if len(calls) == 3:
      raise KeyboardInterrupt  # what SIGINT / a killed step looks like from inside the loop
    return run.run_case(case, *a, **kw)

  monkeypatch.setattr(bench_main, "run_case", stop_on_third)
  out = tmp_path / "r"
  argv = ["--size", "tiny", "--suite", "grpo_loss", "--suite", "optim", "--suite", "rollout"]
  with pytest.raises(KeyboardInterrupt):
    bench_main.main([*argv, "--repeats", "1", "--warmup", "0", "--out", str(out), "--no-plots"])
  payload = json.loads((out / "results.json").read_text())
  assert [c["name"] for c in payload["cases"]] == calls[:2]
  left = payload["partial"]["remaining"]
  assert left[0] == calls[2] and left[-1] == "rollout/tiny"
  assert len(left) == len(all_cases("tiny", "cpu", ("grpo_loss", "optim"))) - 2 + 1
  summary = (out / "summary.md").read_text()
  assert "PARTIAL report" in summary and f"{len(left)} still to run" in summary
  assert calls[0] in summary and calls[2] in summary.split("PARTIAL")[1]
  assert not list(out.glob(".*.tmp"))  # the atomic writes left no temporaries behind
  # the partial report renders as it is (what `python -m bench.report DIR` does after a kill)
  (out / "summary.md").unlink()
  assert report.main([str(out), "--no-plots"]) == 0
  assert "PARTIAL report" in (out / "summary.md").read_text()


def test_a_rollout_suite_stopped_mid_way_keeps_its_measured_rows(tmp_path, monkeypatch):
  """The rollout suite ran ~160 s on the H100: a report written once per suite would lose every row
  of a suite its step's limit cut short. Each row is saved as it is measured: stopped after the first
  row, results.json holds that row and still names the suite as left to run."""
  from bench.rollout import table as rollout_table

  row = rollout_table.RolloutBenchRow(
    "paged", "fixed", 1.0, 64, 64.0, 0.1, 0.9, 8, 0, 0.1, 1e-3, True
  )

  def stop_after_one_row(size, repeats, on_row=None, **kw):
    on_row(row)
    raise KeyboardInterrupt

  monkeypatch.setattr(bench_main.rollout_bench, "run", stop_after_one_row)
  out = tmp_path / "r"
  with pytest.raises(KeyboardInterrupt):
    bench_main.main(["--size", "tiny", "--suite", "rollout", "--out", str(out), "--no-plots"])
  payload = json.loads((out / "results.json").read_text())
  (run_,) = payload["rollout"]
  assert payload["cases"] == []  # `--suite rollout` alone times no kernel case (it timed all 15)
  assert [(r["workload"], r["backend"]) for r in run_["rows"]] == [("fixed", "paged")]
  assert payload["partial"]["remaining"] == ["rollout/tiny"]
  assert "| fixed | paged |" in (out / "summary.md").read_text()


def test_a_finished_run_is_not_marked_partial(tiny_report):
  _, out = tiny_report
  payload = json.loads((out / "r" / "results.json").read_text())
  assert "partial" not in payload
  assert "PARTIAL" not in (out / "r" / "summary.md").read_text()


# ---------------------------------------------------------------------------- parity on the device
def _numpy_and_device(actual, expected, quantity="value", dtype="float32", n=4):
  from bench.kernels.cases import Check
  from bench.kernels.harness import device_parity
  from bench.tolerances import parity_error

  check = Check(0, quantity, dtype, n, "x")
  host = parity_error(np.asarray(actual), np.asarray(expected), quantity, dtype, n)
  dev = device_parity((jnp.asarray(actual),), (jnp.asarray(expected),), (check,))["x"]
  return host, dev


def test_device_parity_matches_a_hand_computed_error():
  """By hand: eps = 2^-23, scale = max|e| = 2.5, atol = 2.5 (4 eps + 8 eps sqrt(4)) = 50 eps,
  bound at e = 2.5: 50 eps + 64 eps * 2.5 = 210 eps; err 0.5 -> 0.5 / (210 eps). Catches a device
  formula that drops a term of the budget (atol or rtol) or takes the scale from the actual."""
  by_hand = 0.5 / (210 * 2.0**-23)
  host, dev = _numpy_and_device([1.0, 2.0], [1.0, 2.5])
  assert host == pytest.approx(by_hand, rel=1e-12)
  assert dev == pytest.approx(by_hand, rel=1e-6)


def test_device_parity_agrees_with_numpy_on_edge_cases_and_bf16():
  """NaN only on one side is inf; a NaN in the reference is NaN (not a pass) on both paths, equal infinities agree; shapes that
  differ are inf; bf16 budgets use bf16's eps (a device path in f32 eps would be 65536x stricter)."""
  nan, inf = float("nan"), float("inf")
  assert _numpy_and_device([1.0, nan], [1.0, 1.0]) == (inf, inf)
  host, dev = _numpy_and_device([nan, 1.0], [nan, 1.0])  # a NaN reference scale: never a pass
  assert np.isnan(host) and np.isnan(dev)
  assert _numpy_and_device([inf, 1.0], [inf, 1.0]) == (0.0, 0.0)  # equal infinities agree
  from bench.kernels.cases import Check
  from bench.kernels.harness import device_parity

  check = Check(0, "grad", "bfloat16", 8, "g")
  assert device_parity((jnp.ones(3),), (jnp.ones(4),), (check,))["g"] == inf
  k = jax.random.split(jax.random.key(0), 2)
  e = jax.random.normal(k[0], (64, 33), jnp.float32).astype(jnp.bfloat16)
  a = (e.astype(jnp.float32) + 0.01 * jax.random.normal(k[1], e.shape)).astype(jnp.bfloat16)
  host, dev = _numpy_and_device(a.astype(jnp.float32), e.astype(jnp.float32), "grad", "bfloat16", 8)
  dev_bf16 = device_parity((a,), (e,), (Check(0, "grad", "bfloat16", 8, "g"),))["g"]
  assert (
    host > 0.1
    and dev == pytest.approx(host, rel=1e-5)
    and dev_bf16 == pytest.approx(host, rel=1e-5)
  )


# ---------------------------------------------------------------------------------- honest ceilings
def test_measured_ceilings_sit_beside_the_datasheet_and_drive_the_fractions():
  """The copy / matmul probes at a small configurable size (on CPU: plumbing, not a ceiling): best >=
  median > 0, the compiled copy really copies (XLA emits a `copy`, so bytes move), the report shows
  measured and datasheet side by side, and fractions use the measured best. Catches a probe that
  times an elided no-op, or a report that silently mixes the two sources."""
  from bench.kernels import roofline

  cfg = roofline.CeilingConfig(copy_bytes=1 << 20, matmul_n=64, iters=2, rounds=3)
  peaks = roofline.measured_peaks(cfg=cfg)
  assert peaks.source == "measured"
  assert peaks.hbm_bytes_per_s >= peaks.hbm_median_bytes_per_s > 0
  assert peaks.bf16_flops_per_s >= peaks.bf16_median_flops_per_s > 0
  hlo = jax.jit(lambda a: jnp.copy(a)).lower(jnp.zeros(256)).compile().as_text()
  assert " copy(" in hlo
  h100 = dataclasses.replace(
    peaks, datasheet_hbm_bytes_per_s=3.35e12, datasheet_bf16_flops_per_s=989e12
  )
  line = report.peaks_line(dataclasses.asdict(h100))
  assert "| HBM bandwidth |" in line and "| 3.35 TB/s |" in line and "| 989 TFLOP/s |" in line
  assert roofline.roofline_fraction(1.0, peaks.hbm_bytes_per_s, None, peaks) == pytest.approx(1.0)
  old = report.peaks_line(dict(hbm_bytes_per_s=2.32e12, bf16_flops_per_s=None, source="measured"))
  assert (
    old == "Bandwidth used for roofline: 2320.0 GB/s (measured)."
  )  # older reports render as before
  with pytest.raises(ValueError, match="copy_bytes >= 1024"):
    roofline.CeilingConfig(copy_bytes=0)


def test_the_committed_h100_example_renders_unchanged(tmp_path):
  """Catches a report change that leaves the committed H100 figures stale or unrenderable: each
  suite's summary.md re-renders from its results.json to the committed text."""
  import shutil

  src = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results" / "example-h100"
  suites = sorted(p.parent.name for p in src.glob("*/results.json"))
  assert suites == ["fused_linear", "grpo_loss", "mosaic_gpu", "paged_attention", "rollout"]
  for suite in suites:
    shutil.copy(src / suite / "results.json", tmp_path / "results.json")
    assert report.main([str(tmp_path), "--no-plots"]) == 0
    assert (tmp_path / "summary.md").read_text() == (src / suite / "summary.md").read_text(), suite


def test_tunix_suite_is_asked_for_and_says_what_it_needs():
  """`--suite tunix` (bench.loop.tunix_memory: 10-30 minutes a compile) is a choice, not part of the
  default run, and without google-tunix it says how to get it instead of failing on an import.
  Catches: the default `nox -s bench` starting hour-long tunix compiles, or a bare ImportError."""
  import importlib.util

  assert bench_main.TUNIX not in bench_main.ALL_SUITES
  assert bench_main.parse_args(["--suite", "tunix"]).suites == ("tunix",)
  if importlib.util.find_spec("tunix") is not None:
    pytest.skip("google-tunix is installed here: the suite would compile for minutes")
  with pytest.raises(SystemExit, match=r"google-tunix: pip install"):
    bench_main.main(["--suite", "tunix"])
