"""bench.trace on traces captured here: a jitted function, and two profiled steps of the GRPO loop."""

import jax
import jax.numpy as jnp
import pytest

from bench import trace

pytest.importorskip("xprof")


def test_summary_of_a_captured_trace(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((128, 128))
  f(x).block_until_ready()
  with trace.capture(str(tmp_path)):
    with jax.profiler.TraceAnnotation("grpo/update"):
      for _ in range(3):
        f(x).block_until_ready()
  s = trace.summarize(str(tmp_path))
  assert s["top"] and all(r["total_us"] >= 0 for r in s["top"])
  assert s["phases_us"]["update"] > 0
  text = trace.format_summary(s)
  assert "update" in text and "top ops" in text


def test_loop_profile_has_the_grpo_phases(tmp_path):
  from tests.rl.test_train import TINY
  from rl import train
  profile_dir = tmp_path / "profile"
  train.main(TINY + [f"run.out_dir={tmp_path / 'run'}", "train.steps=3", "eval.full_at_end=false",
                     "run.profile_steps=1", f"run.profile_dir={profile_dir}"])
  s = trace.main([str(profile_dir)])
  assert {"rollout", "rollout/prefill", "rollout/decode", "reward", "update"} <= set(s["phases_us"])


def test_missing_profile_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no profile"):
    trace.summarize(str(tmp_path))
