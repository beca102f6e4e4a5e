"""bench.trace on traces captured here: a jitted function, and two profiled steps of the GRPO loop."""

import jax
import jax.numpy as jnp
import pytest

from bench import trace
from rl import update as U

pytest.importorskip("xprof")


def test_step_phase_of_hand_written_scope_paths():
  loss, opt = U.LOSS_SCOPE, U.OPTIMIZER_SCOPE
  assert (
    trace.step_phase(f"jit(train_step)/{loss}/while/body/closed_call/jvp()/dot_general")
    == "update/loss fwd"
  )
  assert (
    trace.step_phase(f"jit(train_step)/{loss}/while/body/transpose(jvp())/dot_general")
    == "update/loss bwd"
  )
  assert trace.step_phase(f"jit(train_step)/{opt}/add") == "update/optimizer"
  assert (
    trace.step_phase("jit(train_step)/transpose(jvp())/dot_general") is None
  )  # outside the step's scopes
  assert trace.step_phase(f"jit(f)/{loss}_extra/add") is None  # a scope is a whole path component


def test_self_times_subtract_nested_events():
  ev = lambda ts, dur, tid=1: {"pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": f"{ts}"}
  outer, a, b, other = ev(0, 10), ev(1, 3), ev(5, 2), ev(2, 4, tid=2)
  got = {e["name"]: t for e, t in trace.self_times([outer, a, b, other])}
  assert got == {"0": 5, "1": 3, "5": 2, "2": 4}  # the other thread's event is not the loop's child


def test_wall_shares_split_parallel_time_and_sum_to_the_busy_time():
  """Two threads: ops running at once share the instant, so the split never exceeds wall time (the
  per-thread sum, 15 here, is what made the update split exceed the update phase)."""
  ev = lambda ts, dur, tid: {"pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": f"{tid}"}
  a, b, c = ev(0, 10, 1), ev(5, 5, 2), ev(20, 4, 2)
  shares = trace.wall_shares(trace.innermost_segments([a, b, c]))
  assert shares == {id(a): 7.5, id(b): 2.5, id(c): 4.0}
  assert sum(shares.values()) == 14  # the union of [0, 10] and [20, 24]


def test_summary_of_a_captured_trace(tmp_path):
  """A jitted step with the train step's scopes: the summary splits its op time into the three phases."""

  def step(w, x):
    def loss(w):
      return jnp.sum(jnp.tanh(x @ w) ** 2)

    with jax.named_scope(U.LOSS_SCOPE):
      g = jax.grad(loss)(w)
    with jax.named_scope(U.OPTIMIZER_SCOPE):
      return w - 0.1 * jnp.sign(g) * jnp.sqrt(jnp.abs(g))

  f = jax.jit(step)
  w, x = jnp.ones((128, 128)), jnp.ones((64, 128))
  f(w, x).block_until_ready()
  with trace.capture(str(tmp_path)), jax.profiler.TraceAnnotation("grpo/update"):
    for _ in range(3):
      f(w, x).block_until_ready()
  s = trace.summarize(str(tmp_path))
  assert s["top"] and all(r["total_us"] >= 0 for r in s["top"])
  # the share column (the device call's "where does a step go"): a fraction of every op's time
  assert 0 < sum(r["share"] for r in s["top"]) <= 1 + 1e-9
  assert s["top"][0]["share"] == pytest.approx(s["top"][0]["total_us"] / s["ops_total_us"])
  assert any(r["scope"] and U.LOSS_SCOPE in r["scope"] for r in s["top"])
  assert s["phases_us"]["update"] > 0
  split = s["update_split_us"]
  assert {"update/loss fwd", "update/loss bwd", "update/optimizer"} <= set(split), split
  assert all(v > 0 for v in split.values())
  text = trace.format_summary(s)
  assert "update" in text and "top ops" in text and "update/loss bwd" in text


def test_loop_profile_has_the_grpo_phases(tmp_path):
  from rl import train
  from tests.rl.test_train import TINY

  profile_dir = tmp_path / "profile"
  train.main(
    TINY
    + [
      f"run.out_dir={tmp_path / 'run'}",
      "train.steps=3",
      "eval.full_at_end=false",
      "run.profile_steps=1",
      f"run.profile_dir={profile_dir}",
    ]
  )
  s = trace.main([str(profile_dir)])
  assert {"rollout", "rollout/prefill", "rollout/decode", "reward", "update"} <= set(s["phases_us"])
  split = s["update_split_us"]
  assert {"update/loss fwd", "update/loss bwd", "update/optimizer"} <= set(split), split
  assert all(split[k] > 0 for k in ("update/loss fwd", "update/loss bwd", "update/optimizer"))


def test_missing_profile_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no profile"):
    trace.summarize(str(tmp_path))
