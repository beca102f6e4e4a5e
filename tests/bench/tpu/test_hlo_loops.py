"""bench.tpu.hlo_loops and the compiled report's model: loops counted by their trip counts, never below
the case's byte or flop floor, and no figure XLA gives negative ever used.

``tests/data/hlo_loops/chunked-fwd-bwd-v6e.hlo`` is the optimized HLO libtpu 0.0.42.1 (jax 0.10.2)
compiled for v6e from the fused head's ``chunked`` path, forward and backward, at N = 512 tokens in
chunks of 128 (H 256, V 1000, bf16): a ``lax.scan`` of 4 trips around the statistics and backward
kernels and three matmuls per chunk. Trimmed of its metadata and backend configs (the Mosaic kernels'
serialized code) only. The live compiled report is tested in tests/bench/tpu/test_compiled_report.py.
"""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from bench.tpu import compiled, hlo_loops
from kernels import tpu_targets

DATA = pathlib.Path(__file__).parents[2] / "data" / "hlo_loops"
V6E = tpu_targets.generation("v6e")


def test_tpu_scan_trip_count_and_kernel_runs():
  """Catches: a scan body's kernels counted once (the compiled report modelled the chunked fused
  head at 1.04 ms / 5.36 ms, below its 5.55 / 16.66 ms flop floor), the trip count read from the
  bound alone (the counter starts at a constant copied into the loop's init tuple, and XLA:TPU
  writes no known_trip_count), the matmuls inside fusions called from the body missed."""
  loops = hlo_loops.read((DATA / "chunked-fwd-bwd-v6e.hlo").read_text())
  assert loops.trips == [4] and loops.unknown == []
  assert loops.kernels == {"grpo_loss_fwd.4": 4, "grpo_loss_bwd.4": 4}
  # per chunk: logits [128, 1000] = h @ w, dh [128, 256] = dl @ w^T, dw [256, 1000] += h^T @ dl
  per_trip = 3 * 2 * 128 * 256 * 1000
  assert loops.uncounted_dot_flops == 3 * per_trip  # XLA's cost model counted the first trip


def test_cpu_scan_and_an_unknown_bound():
  """Catches: XLA's own known_trip_count ignored, a data-dependent loop given a made-up trip
  count instead of being reported (it is counted once and the model says so)."""
  f = lambda x, w: jax.lax.scan(lambda c, xi: (c + jnp.sum(xi @ w), None), 0.0, x)[0]
  text = jax.jit(f).lower(jnp.ones((7, 16, 32)), jnp.ones((32, 8))).compile().as_text()
  loops = hlo_loops.read(text)
  assert loops.trips == [7]
  assert loops.uncounted_dot_flops == 6 * 2 * 16 * 32 * 8

  def g(n, x):
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ x), (0, x))[1]

  loops = hlo_loops.read(jax.jit(g).lower(3, jnp.ones((8, 8))).compile().as_text())
  assert loops.trips == [None] and len(loops.unknown) == 1
  assert loops.uncounted_dot_flops == 0


def _kernel_side(optimal_s, runs=4, bundles=1000, grid=(8,)):
  sched = dict(
        name="k.1", total_bundles=bundles + 10, grid=grid, step_bundles=bundles,
        loops=[dict(start=0, depth=1, bundles=bundles, trip=None, children=[])], problems=[],
    )  # fmt: skip
  loops = dict(trips=[runs], kernels={"k.1": runs}, uncounted_dot_flops=2e12, unknown=[])
  return dict(status="ok", cost={"optimal_s": optimal_s}, kernels=[sched], loops=loops)


@pytest.mark.parametrize("optimal_s", [-23.990415573120117, None, float("nan")])
def test_model_never_uses_a_figure_that_is_not_a_time(optimal_s):
  """Catches: XLA's negative optimal time (-23990.416 ms for the optimizer's reference at the 0.5B
  tree) or a missing one summed into the compute, which printed negative compute floors."""
  m = compiled.model({"bytes": 1e6, "flops": None}, _kernel_side(optimal_s), V6E)
  kernel_s = 4 * (10 + 1000 * 8) / V6E.clock_hz
  assert m["compute_s"] == pytest.approx(kernel_s + 2e12 / V6E.bf16_flops)
  assert any("not used" in n for n in m["notes"])
  assert m["modelled_s"] >= 0


def test_model_counts_trips_and_never_beats_the_floors():
  """Catches: a kernel inside a loop counted once, the loop body's matmuls left out, a modelled
  time below its case's flop floor (flops at the bf16 peak) or byte floor."""
  side = _kernel_side(1e-3)
  m = compiled.model({"bytes": 1e6, "flops": 1e15}, side, V6E)
  kernel_s = 4 * (10 + 1000 * 8) / V6E.clock_hz
  assert m["compute_s"] == pytest.approx(1e-3 + kernel_s + 2e12 / V6E.bf16_flops)
  assert m["modelled_s"] == pytest.approx(1e15 / V6E.bf16_flops)  # the flop floor binds
  assert m["bound"].startswith("flops at peak")
  m = compiled.model({"bytes": 1e13, "flops": None}, side, V6E)
  assert m["modelled_s"] == pytest.approx(1e13 / V6E.hbm_bw) and m["bound"] == "memory"
  side["loops"]["kernels"] = {}  # a kernel the HLO does not name: once, and said to be a bound
  m = compiled.model({"bytes": 1.0, "flops": None}, side, V6E)
  assert m["lower_bound"] and "lower bound" in m["bound"]


# Four row superblocks of the fused head's gradient kernel as libtpu 0.0.42.1 compiles them for v6e
# at 512 x 1536 tiles: the two middle calls carry the same Mosaic program (their backend_config),
# which libtpu compiles once and dumps under the first one's name only.
_SUPERBLOCKS = """HloModule m

ENTRY %main.18 (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %g.4 = f32[8]{0} custom-call(f32[8]{0} %p), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "FIRST"}}
  %g.5 = f32[8]{0} custom-call(f32[8]{0} %g.4), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "MIDDLE"}}
  %g.6 = f32[8]{0} custom-call(f32[8]{0} %g.5), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "MIDDLE"}}
  ROOT %g.7 = f32[8]{0} custom-call(f32[8]{0} %g.6), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "LAST"}}
}
"""


def test_one_program_called_twice_is_charged_twice():
  """Catches: a kernel whose program libtpu compiled once for two calls counted for one (the fused
  head's fwd+bwd at 512 x 1536 on v6e was modelled at 19.74 ms, one of its four 4.31 ms superblocks
  left out), and the same program charged twice over where it is dumped under both names."""
  loops = hlo_loops.read(_SUPERBLOCKS)
  assert loops.kernels == {"g.4": 1, "g.5": 1, "g.6": 1, "g.7": 1}
  assert loops.same_program == {"g.4": "g.4", "g.5": "g.5", "g.6": "g.5", "g.7": "g.7"}
  side = _kernel_side(0.0, runs=1)
  side["loops"] = loops.as_dict()
  side["kernels"] = [dict(side["kernels"][0], name=n) for n in ("g.4", "g.5", "g.7")]
  kernel_s = (10 + 1000 * 8) / V6E.clock_hz
  m = compiled.model({"bytes": 1.0, "flops": None}, side, V6E)
  assert m["compute_s"] == pytest.approx(4 * kernel_s) and not m["lower_bound"]
  side["kernels"].append(dict(side["kernels"][0], name="g.6"))  # dumped under both names
  assert compiled.model({"bytes": 1.0, "flops": None}, side, V6E)["compute_s"] == pytest.approx(4 * kernel_s)  # fmt: skip


# The vocab-tiled loss statistics as libtpu 0.0.42.1 compiles them for v4 (trimmed): the one-sweep
# kernel, then a conditional whose second branch runs the exact kernel only when a row is flagged.
_FALLBACK = """HloModule m

%region_3.10 (a: (f32[8], f32[8])) -> f32[8] {
  %a = (f32[8]{0}, f32[8]{0}) parameter(0)
  ROOT %gte = f32[8]{0} get-tuple-element((f32[8]{0}, f32[8]{0}) %a), index=0
}

%region_4.11 (b: (f32[8], f32[8])) -> f32[8] {
  %b = (f32[8]{0}, f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element((f32[8]{0}, f32[8]{0}) %b), index=1
  ROOT %s_fallback.1 = f32[8]{0} custom-call(f32[8]{0} %x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "EXACT"}}
}

ENTRY %main.9 (p: f32[8], q: s32[]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %q = s32[] parameter(1)
  %s.1 = f32[8]{0} custom-call(f32[8]{0} %p), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "FAST"}}
  %t = (f32[8]{0}, f32[8]{0}) tuple(f32[8]{0} %s.1, f32[8]{0} %p)
  %cond.8 = f32[8]{0} conditional(s32[] %q, (f32[8]{0}, f32[8]{0}) %t, (f32[8]{0}, f32[8]{0}) %t), branch_computations={%region_3.10, %region_4.11}
  ROOT %other_fallback.2 = f32[8]{0} custom-call(f32[8]{0} %cond.8), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "ALWAYS"}}
}
"""


def test_a_conditional_fallback_kernel_is_listed_not_charged():
  """Catches: the exact kernel that runs only for flagged rows charged on every call (the v4 bf16
  V = 262144 forward modelled as both kernels), a kernel named *_fallback outside a conditional
  (it always runs) or in a conditional whose other branch runs kernels too dropped from the
  model, the fallback left out silently (no note)."""
  loops = hlo_loops.read(_FALLBACK)
  assert loops.kernels == {"s_fallback.1": 0, "s.1": 1, "other_fallback.2": 1}
  assert loops.fallback == {"s_fallback.1": 1}
  side = _kernel_side(0.0, runs=1)
  side["loops"] = loops.as_dict()
  side["kernels"] = [dict(side["kernels"][0], name=n) for n in loops.kernels]
  m = compiled.model({"bytes": 1.0, "flops": None}, side, V6E)
  assert m["compute_s"] == pytest.approx(2 * (10 + 1000 * 8) / V6E.clock_hz)
  assert any("s_fallback.1" in n and "not charged" in n for n in m["notes"])
  # both branches run kernels: which one runs is the data's choice, so both are charged
  both = _FALLBACK.replace(
    "ROOT %gte = f32[8]{0} get-tuple-element((f32[8]{0}, f32[8]{0}) %a), index=0",
    "%gte = f32[8]{0} get-tuple-element((f32[8]{0}, f32[8]{0}) %a), index=0\n"
    '  ROOT %u.3 = f32[8]{0} custom-call(f32[8]{0} %gte), custom_call_target="tpu_custom_call"',
  )
  loops = hlo_loops.read(both)
  assert loops.fallback == {} and loops.kernels["s_fallback.1"] == 1 and loops.kernels["u.3"] == 1
