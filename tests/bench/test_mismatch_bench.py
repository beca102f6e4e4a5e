"""bench.mismatch at tiny size: every engine row, sglang_jax skipped cleanly where it cannot run, the
top-k / top-p rows' mismatch is the filter's (gone against the filtered trainer), and a wrong engine
shows up."""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import mismatch, report
from rl.model import init_model, preset, scale_weights


@pytest.fixture(scope="module")
def rows():
  engines = ("paged", "dense", "sglang_jax")
  return mismatch.run("tiny", engines=engines, dtypes=("bfloat16",), numerics=("xla",))


def test_table_covers_every_engine_and_sampling(rows):
  ran = [r for r in rows if not r.skipped]
  filtered = [s for s in mismatch.SAMPLINGS if s != "plain"]
  assert {(r.engine, r.sampling) for r in ran} == {
    (e, s)
    for e in ("paged", "dense")
    for s in [*mismatch.SAMPLINGS, *(f + mismatch.TRUNCATED for f in filtered)]
  }
  size = mismatch.SIZES["tiny"]
  assert all(r.tokens == size["prompts"] * size["n"] * size["new_tokens"] for r in ran)
  sglang = [r for r in rows if r.engine == "sglang_jax"]
  assert len(sglang) == 1 and (sglang[0].skipped is None) == (
    mismatch.skip_reason("sglang_jax", init_model(preset("tiny")).cfg) is None
  )
  table = mismatch.markdown(rows)
  assert table.count("\n") == len(rows) + 1 and "skipped" in table


def test_filtered_sampling_mismatch_is_the_filters_own(rows):
  for r in (r for r in rows if not r.skipped):
    assert 0.0 <= r.abs_mean <= r.abs_p99 <= r.abs_max and r.k3_kl >= 0.0
    assert r.exp_abs_mean >= 1.0
    # against the trainer under the same filter only the engine's numerics are left (bf16 here)
    assert r.filtered_abs_max < 0.05 and r.filtered_outside == 0
    if r.sampling == "plain":  # no filter: both comparisons are the same
      assert math.isclose(r.filtered_abs_max, r.abs_max, rel_tol=1e-6)
    elif r.sampling.endswith(mismatch.TRUNCATED):  # scored over the sampled support: numerics only
      assert r.abs_max < 0.05
    else:  # the engine reports the renormalised truncated log-prob: >= the full softmax's
      assert r.abs_mean > 10 * r.filtered_abs_max


def test_truncated_rows_are_within_2x_of_the_unfiltered_row():
  """Issue 48's target, in f32: scored over each token's sampled support (the engine's gaps), a
  filtered row's mean |dlogp| is within 2x of the same engine's unfiltered row (the full-softmax
  row is ~1e5x). Catches the trainer scoring filtered samples under the full softmax, and gaps that
  drop the boundary token when the trainer's logits round unlike the engine's (at the smallest kept
  logit itself: a few 1e-3 nats on half the tokens). In bf16 it holds with XLA's excess precision
  off (bench/results/example-cpu-mismatch-exact-bf16, `--exact-bf16`: a process-wide XLA flag, so not
  in this process) and with batch-invariant numerics (the next test), not with XLA's defaults
  (bench/results/example-cpu-mismatch, docs/rollout.md)."""
  f32 = mismatch.run("tiny", engines=("paged", "dense"), dtypes=("float32",))
  ran = {(r.engine, r.sampling): r for r in f32}
  truncated = [key for key in ran if key[1].endswith(mismatch.TRUNCATED)]
  assert len(truncated) == 2
  for engine, sampling in truncated:
    r, plain = ran[engine, sampling], ran[engine, "plain"]
    assert r.abs_mean <= 2 * plain.abs_mean, (engine, r.abs_mean, plain.abs_mean)


def test_bf16_truncated_rows_are_within_2x_under_batch_invariant_numerics():
  """Issue 48's target in bf16, without process flags: with ModelConfig.batch_invariant the engines'
  decode gives each token the trainer's hidden state bit for bit, so no token crosses its support's
  edge and the truncated rows sit with the unfiltered ones at f32 round-off. Catches a decode step
  (dense or paged) that reduces or rounds unlike the trainer's forward: one differing state moves
  boundary tokens by ~1e-2 nats."""
  rows = mismatch.run(
    "tiny",
    engines=("paged", "dense", "sglang_jax"),
    dtypes=("bfloat16",),
    numerics=("batch-invariant",),
  )
  ran = {(r.engine, r.sampling): r for r in rows if not r.skipped}
  assert [r.engine for r in rows if r.skipped] == ["sglang_jax"]
  truncated = [key for key in ran if key[1].endswith(mismatch.TRUNCATED)]
  assert len(truncated) == 2
  for engine, sampling in truncated:
    r, plain = ran[engine, sampling], ran[engine, "plain"]
    assert r.abs_max < 1e-5 and plain.abs_max < 1e-5, (engine, r.abs_max, plain.abs_max)
    assert r.abs_mean <= 2 * plain.abs_mean, (engine, r.abs_mean, plain.abs_mean)


def test_the_numerics_arms_refuse_what_cannot_be_invariant():
  """A paged engine on a decode kernel cannot give the trainer's bits: its batch-invariant row is
  skipped with the reason (not a crashed suite); an arm list with nothing to run is an error."""
  cfg = preset("tiny", batch_invariant=True)
  assert "kernel" in mismatch.skip_reason("paged:pallas", cfg)
  assert mismatch.skip_reason("paged", cfg) is None and mismatch.skip_reason("dense", cfg) is None
  assert mismatch.skip_reason("paged:pallas", preset("tiny")) is None
  with pytest.raises(ValueError, match="bf16 only"):
    mismatch.run("tiny", dtypes=("float32",), numerics=("batch-invariant",))


def test_the_measure_catches_a_wrong_engine():
  """Log-probs from other weights (a stale or mis-synced engine) give a large mismatch."""
  size = mismatch.SIZES["tiny"]
  model = scale_weights(init_model(preset("tiny"), seed=0), 10.0)
  other = scale_weights(init_model(preset("tiny"), seed=1), 10.0)
  engine = mismatch.make(other, size, "paged")
  res = engine.generate(*mismatch.requests(size, 0, 1.0))
  (wrong,) = mismatch.measure(model, res, size, 0, 1.0)
  (right,) = mismatch.measure(other, res, size, 0, 1.0)
  assert wrong["abs_max"] > 1.0 and wrong["k3_kl"] > 0.1
  assert right["abs_max"] < 0.05
  with pytest.raises(ValueError, match="paged:<one of"):
    mismatch.make(model, size, "dense:xla")
  assert np.isfinite(list(wrong.values())).all()


def test_the_bench_report_renders_the_mismatch_table(rows, tmp_path):
  """`python -m bench --suite mismatch` is accepted, and a report's results.json with a mismatch run
  re-renders its table (beside the committed example's other sections)."""
  assert bench_main.parse_args(["--suite", "mismatch"]).suites == ("mismatch",)
  src = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results" / "example-cpu"
  payload = json.loads((src / "results.json").read_text())
  run = dict(size="tiny", config=mismatch.SIZES["tiny"], rows=[dataclasses.asdict(r) for r in rows])
  payload["mismatch"] = [run]
  (tmp_path / "results.json").write_text(json.dumps(payload))
  assert report.main([str(tmp_path), "--no-plots"]) == 0
  summary = (tmp_path / "summary.md").read_text()
  assert "## Engine log-probs vs the trainer (tiny: model tiny" in summary
  assert mismatch.markdown(rows) in summary and "Rollout engines" in summary


def test_exact_bf16_sets_the_flag_before_the_backend_starts():
  """`--exact-bf16` turns XLA's excess precision off for a fresh process, and refuses once a backend
  runs (XLA reads its flags once: a flag set later would be silently ignored)."""
  code = (
    "import os; from bench import mismatch; mismatch.exact_bf16(); import jax; jax.numpy.ones(1)"
    "; print(os.environ['XLA_FLAGS'])"
  )
  root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, PYTHONPATH=str(root), XLA_FLAGS="--xla_cpu_enable_fast_math=false")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["--xla_cpu_enable_fast_math=false", mismatch.EXACT_BF16_FLAG]
  jax.devices()  # this process's backend runs
  with pytest.raises(RuntimeError, match="already started"):
    mismatch.exact_bf16()
