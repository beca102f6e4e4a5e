"""The rollout throughput bench runs end to end, reports both backends on the same work, and checks
its engines' log-probs against a teacher-forced forward (a check that catches a wrong engine)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.rollout import parity, throughput
from bench.rollout.table import markdown
from bench.tolerances import FLOOR_FACTOR, parity_error
from rl.model import init_model, preset, scale_weights
from rl.model.cache import DenseKVCache, attention
from rl.rollout import EngineConfig, make_engine


def test_rollout_bench_reports_both_backends(tmp_path):
  rows, extra = throughput.run("tiny", repeats=1)
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
  # the gate (f32 + highest run) decides ok; the bf16 run's divergence is reported beside it
  assert all(r.ok and r.gate_parity <= 1.0 and r.rounding_ulps < 4.0 for r in rows)
  table = markdown(rows, extra)
  assert "time vs dense (measured)" in table and "bytes vs dense (compiled)" in table
  argv = ["--size", "tiny", "--repeats", "1", "--warmup", "0", "--backend", "paged"]
  assert throughput.main([*argv, "--out", str(tmp_path)]) == 0  # the CLI, one backend: cheap
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
  size = throughput.SIZES["tiny"]
  prompts, params = throughput.workload(size, "fixed")
  engine = make_engine(
    model, EngineConfig(backend="paged", max_seq_len=16, max_slots=4, page_size=8), eos_ids=[]
  )
  res = engine.generate(prompts, params)
  err, _, floor = parity.teacher_forced_error(model, res, size["prompt_len"], size["new_tokens"])
  assert err <= 1.0
  # the floor is the same model's forward under two layouts: rounding-sized, never a model-sized gap
  # (a floor taken against the wrong rows or model would let any engine through)
  assert 0.0 <= floor < 1e-3
  # the log-probs of a different model (as a stale or mis-synced engine would report) fail the check
  other = scale_weights(init_model(preset("tiny"), seed=1), 10.0)
  assert parity.teacher_forced_error(other, res, size["prompt_len"], size["new_tokens"])[0] > 1.0
  greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
  a, b = engine.generate(prompts, greedy), engine.generate(prompts, greedy)
  assert parity.greedy_agreement(a, b) == 1.0
  b.completions[0].token_ids = b.completions[0].token_ids + 1
  assert parity.greedy_agreement(a, b) == 0.75


@dataclasses.dataclass(frozen=True)
class _CopyingCache(DenseKVCache):
  """The dense cache written with a masked rewrite instead of a scatter (`where(slot == position,
  new, old)` over the whole cache): every layer of every step reads and writes the whole cache.
  (The bf16-values cache that XLA:CPU used to round-trip through f32 is in place on jax 0.11.)"""

  @classmethod
  def create(cls, *args, **kwargs):
    c = DenseKVCache.create(*args, **kwargs)
    return cls(c.k, c.v, c.value_dtype)

  def attend(self, layer, q, k, v, positions, *, invariant=False):  # decode only: positions [B, 1]
    num_layers, _, max_len = self.k.shape[:3]
    hit = (jnp.arange(num_layers)[:, None, None] == layer) & (
      jnp.arange(max_len)[None, None, :] == positions[None, :, :1]
    )  # [L, B, S]
    write = lambda old, new: jnp.where(hit[..., None, None], self._stored(new)[None], old)
    new_k, new_v = write(self.k, k), write(self.v, v)
    visible = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]
    kd, vd = self.values(new_k[layer]), self.values(new_v[layer])
    out = attention(q, kd.astype(q.dtype), vd.astype(q.dtype), visible, invariant)
    return out, dataclasses.replace(self, k=new_k, v=new_v)


jax.tree_util.register_dataclass(_CopyingCache, data_fields=["k", "v"], meta_fields=["value_dtype"])


@pytest.mark.slow  # four compiles, ~50 s on the shared 2-core host
def test_byte_account_catches_a_per_step_weight_cast_and_cache_copy():
  """The decode step's byte account (XLA cost analysis of the compiled chunk, compile only) at a
  small shape, one step per chunk (so a cast XLA hoists out of the step loop still counts). Catches
  the two classic wastes: the f32 master weights cast to bf16 in every call (the engines used to
  pass the raw parameters; at this shape XLA:CPU upcasts bf16 dot operands anyway, so the cast
  shows as a small excess, the engine-side check is in tests/rl/rollout/test_rollout.py) and a per-step copy
  of the cache (`_CopyingCache`, a masked rewrite of the whole cache instead of a scatter: at least
  one whole cache more per step than the engines' in-place scatter)."""
  from bench.rollout import byte_account

  cfg = preset("tiny")
  held = byte_account.account(cfg, "paged", batch=8, context=64, page_size=16, steps_per_sync=1)
  cast = byte_account.account(cfg, "paged", 8, 64, 16, 1, weights_dtype=None)
  dense = byte_account.account(cfg, "dense", 8, 64, 16, 1)
  copying = byte_account.account(cfg, "dense", 8, 64, 16, 1, dense_cache=_CopyingCache)
  assert held.weights == cast.weights > 0 and held.ideal == held.weights + held.kv + held.logits
  assert cast.accessed > held.accessed  # the per-call cast shows
  assert copying.accessed >= dense.accessed + dense.cache_bytes  # the per-step cache copy shows
  assert held.inplace_fix > 0 and dense.inplace_fix > 0  # scatters recognised as in place


def test_inplace_fix_charges_fused_scatter_and_gather_by_what_they_touch():
  """By hand on HLO text: a fusion around an in-place scatter into a [4, 1024] u16 pool, and one
  around a gather of 2 rows of it, are charged their updates / gathered rows, not the whole pool."""
  from bench.rollout.byte_account import inplace_fix

  hlo = """
%sc (p0: u16[4,1024], p1: s32[2,1], p2: u16[2,1024]) -> u16[4,1024] {
  %p0 = u16[4,1024]{1,0} parameter(0)
  %p1 = s32[2,1]{1,0} parameter(1)
  %p2 = u16[2,1024]{1,0} parameter(2)
  ROOT %s = u16[4,1024]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1}
}

%ga (q0: u16[4,1024], q1: s32[2,1]) -> f32[2,1024] {
  %q0 = u16[4,1024]{1,0} parameter(0)
  %q1 = s32[2,1]{1,0} parameter(1)
  %c = bf16[4,1024]{1,0} bitcast-convert(%q0)
  %g = bf16[2,1024]{1,0} gather(%c, %q1), offset_dims={1}
  ROOT %f = f32[2,1024]{1,0} convert(%g)
}

ENTRY %main (a: u16[4,1024], i: s32[2,1], u: u16[2,1024]) -> f32[2,1024] {
  %a = u16[4,1024]{1,0} parameter(0)
  %i = s32[2,1]{1,0} parameter(1)
  %u = u16[2,1024]{1,0} parameter(2)
  %x = u16[4,1024]{1,0} fusion(%a, %i, %u), kind=kLoop, calls=%sc
  ROOT %y = f32[2,1024]{1,0} fusion(%x, %i), kind=kLoop, calls=%ga
}
"""
  pool, rows = 4 * 1024 * 2, 2 * 1024 * 2
  # scatter: operand and result charged as the update (pool - rows each); gather: the rows it reads
  assert inplace_fix(hlo) == 2 * (pool - rows) + (pool - rows)
