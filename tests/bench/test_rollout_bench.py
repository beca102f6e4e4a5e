"""The rollout throughput bench runs end to end, reports both backends on the same work, and checks
its engines' log-probs against a teacher-forced forward (a check that catches a wrong engine)."""

import dataclasses

import numpy as np
import pytest

from bench import rollout
from bench.tolerances import FLOOR_FACTOR, parity_error
from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, make_engine


def test_rollout_bench_reports_both_backends(tmp_path):
  rows, extra = rollout.run("tiny", repeats=1)
  assert {(r.backend, r.workload) for r in rows} == {
    (b, w) for b in ("paged", "dense") for w in ("fixed", "varied")
  }
  by = {(r.backend, r.workload): r for r in rows}
  for w in ("fixed", "varied"):
    assert (
      by["paged", w].tokens == by["dense", w].tokens > 0
    )  # same work, every request to its length
    assert by["paged", w].tokens_per_s > 0
    assert 0.0 <= extra["greedy_agreement"][w]["paged"] <= 1.0
  assert by["paged", "fixed"].tokens == 2 * 2 * 8
  assert all(r.ok and r.logprob_parity <= 1.0 for r in rows)
  assert "speedup vs dense" in rollout.markdown(rows, extra)
  assert rollout.main(["--size", "tiny", "--repeats", "1", "--out", str(tmp_path)]) == 0
  assert (tmp_path / "results.json").exists() and (tmp_path / "summary.md").exists()


def test_parity_error_allows_the_measured_floor_times_the_factor():
  """By hand: a 1e-3 difference on log-probs near 0 (table bound ~1e-5 nats in f32) fails alone,
  passes once the measured floor is 2e-4 (bound 8 x 2e-4), and fails again at floor 1e-4 (bound 8e-4)."""
  expected = np.array([-0.5, -0.25, -1.0])
  actual = expected + np.array([0.0, 1e-3, 0.0])
  assert parity_error(actual, expected, "value", np.float32, 64) > 50
  assert parity_error(actual, expected, "value", np.float32, 64, floor=2e-4) == pytest.approx(
    1e-3 / (FLOOR_FACTOR * 2e-4)
  )
  assert parity_error(actual, expected, "value", np.float32, 64, floor=1e-4) > 1.0


def test_teacher_forced_check_catches_wrong_logprobs():
  model = scale_weights(init_model(preset("tiny"), seed=0), 10.0)
  size = rollout.SIZES["tiny"]
  prompts, params = rollout.workload(size, "fixed")
  engine = make_engine(
    model, EngineConfig(backend="paged", max_seq_len=16, max_slots=4, page_size=8), eos_ids=[]
  )
  res = engine.generate(prompts, params)
  err, _, floor = rollout.teacher_forced_error(model, res, size["prompt_len"], size["new_tokens"])
  assert err <= 1.0
  # the floor is the same model's forward under two layouts: rounding-sized, never a model-sized gap
  # (a floor taken against the wrong rows or model would let any engine through)
  assert 0.0 <= floor < 1e-3
  # the log-probs of a different model (as a stale or mis-synced engine would report) fail the check
  other = scale_weights(init_model(preset("tiny"), seed=1), 10.0)
  assert rollout.teacher_forced_error(other, res, size["prompt_len"], size["new_tokens"])[0] > 1.0
  greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
  a, b = engine.generate(prompts, greedy), engine.generate(prompts, greedy)
  assert rollout.greedy_agreement(a, b) == 1.0
  b.completions[0].token_ids = b.completions[0].token_ids + 1
  assert rollout.greedy_agreement(a, b) == 0.75
