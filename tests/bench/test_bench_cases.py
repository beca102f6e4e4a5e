"""The bench cases through pytest-benchmark: ``pytest tests/bench --benchmark-only``.

Kernel and reference of a case share a benchmark group, so pytest-benchmark prints them side by side
(``--benchmark-autosave`` / ``--benchmark-compare`` track them across runs). The kernel side asserts
parity first: a fast wrong kernel fails instead of timing. The rollout suite's cases (bench/rollout/throughput.py:
workload x backend, one `generate` call timed) share a group per workload the same way, each engine's
log-probs checked against a teacher-forced forward before it is timed. The default test run passes
``--benchmark-disable``, which runs each body once as a smoke test, at the harness's tiny size; a
benchmarking run uses the bench's size for the backend (small on CPU, large on an accelerator).
"""

import functools

import jax
import numpy as np
import pytest

from bench.kernels import harness
from bench.kernels.cases import all_cases
from bench.rollout import parity as rollout_parity
from bench.rollout import throughput as rollout
from bench.tolerances import parity_error
from kernels import backend

_TARGET = backend.resolve()


def _size(config) -> str:
  timing = not config.getoption("benchmark_disable")
  return ("small" if _TARGET.platform == "cpu" else "large") if timing else "tiny"


def pytest_generate_tests(metafunc):
  if "case" in metafunc.fixturenames:
    metafunc.parametrize(
      "case", all_cases(_size(metafunc.config), _TARGET.platform), ids=lambda c: c.name
    )
  if "rollout_size" in metafunc.fixturenames:
    metafunc.parametrize("rollout_size", [_size(metafunc.config)])


@pytest.mark.parametrize("side", ["kernel", "reference"])
def test_bench(benchmark, case, side):
  args = case.make_inputs(0)
  compiled, _ = harness.compile_fn(getattr(case, side), args)
  if side == "kernel":
    ref_out = jax.tree.leaves(jax.jit(case.reference)(*args))
    out = jax.tree.leaves(compiled(*args))
    for c in case.checks:
      err = max(
        parity_error(
          np.asarray(out[i]), np.asarray(ref_out[i]), c.quantity, c.dtype, c.reduction_len
        )
        for i in (c.index if isinstance(c.index, tuple) else (c.index,))
      )
      assert err <= 1.0, f"{case.name} {c.label}: error {err:.3g}x the tolerance"
  benchmark.group = case.name
  benchmark.extra_info.update(case.params, bytes=case.bytes, interpret=_TARGET.interpret)
  benchmark.pedantic(lambda: jax.block_until_ready(compiled(*args)), warmup_rounds=2, rounds=10)


@functools.cache
def _rollout_model(size: str):
  return rollout.bench_model(size)


@pytest.mark.parametrize("backend", rollout.BACKENDS)
@pytest.mark.parametrize("workload", rollout.WORKLOADS)
def test_rollout(benchmark, rollout_size, workload, backend):
  model = _rollout_model(rollout_size)
  size = rollout.SIZES[rollout_size]
  prompts, params = rollout.workload(size, workload)
  # parity before any timing, gated as bench.rollout.throughput gates it: the engine on the model's f32 twin at
  # GATE_PRECISION against the teacher-forced forward at the same precision (a compute-dtype gate
  # fails correct engines on a GPU, whose bf16 and default-precision f32 dots round differently)
  gated = rollout.gates(rollout_parity.gate_model(model), rollout_size, backend, (workload,))[
    workload
  ]
  assert gated.err <= 1.0, (
    f"{backend} log-probs off a teacher-forced forward: {gated.err:.3g}x the tolerance "
    f"({gated.max_abs_diff:.3g} nats)"
  )
  engine = rollout.bench_engine(model, rollout_size, backend)
  try:
    result = engine.generate(prompts, params)  # compiles before the timed rounds
    benchmark.group = f"rollout/{rollout_size}/{workload}"
    benchmark.extra_info.update(size, backend=backend, tokens=result.stats.generated_tokens)
    benchmark.pedantic(lambda: engine.generate(prompts, params), warmup_rounds=0, rounds=3)
  finally:
    engine.close()


# ----------------------------------------------------------------------------------------- peers
def _fake_peer(scale: float = 1.0):
  """A jax stand-in for a peer (the real ones need torch / tokamax and a GPU): the sum cross-entropy
  over grpo_loss's logits, forward + backward, times ``scale``."""
  from bench.kernels.cases import peers

  def build(inputs):
    logits, ids = inputs[0], inputs[1]  # [B, T, V], [B, T]

    def ce(x):
      logp = jax.nn.log_softmax(x.astype(jax.numpy.float32), axis=-1)
      return -scale * jax.numpy.take_along_axis(logp, ids[..., None], axis=-1).sum()

    fn = jax.jit(jax.value_and_grad(ce))
    out = []

    def step():
      out[:] = [fn(logits)]
      return float(out[0][0])

    return step, lambda: jax.block_until_ready(out)

  return peers.Peer("fake-ce", "grpo_loss", "sum cross-entropy", lambda platform: None, build)


def test_peers_are_skipped_with_their_reason_where_missing():
  """Catches an import error crashing the run where Liger / tokamax / torch are absent (CPU, CI):
  every real peer yields a skipped row naming what is missing."""
  from bench.kernels.cases import peers
  from bench.report import markdown_table

  for peer, shape in peers.rows("tiny"):
    r = peers.run_peer(peer, shape, "cpu", repeats=1, warmup=0)
    assert r.ok and r.kernel is None and r.skipped, r
    assert "not installed" in r.skipped or "need a GPU" in r.skipped or "CUDA" in r.skipped
    assert f"| {r.name} | skipped: {r.skipped} |" in markdown_table([r])


def test_a_peer_row_times_both_sides_and_checks_the_peers_value():
  """The row plumbing with a fake peer: both sides timed, the peer's loss checked against minus the
  sum of our kernel's log-probs; a peer off by 1% fails its row (catches a parity that compares the
  peer with itself, or with our GRPO loss value instead of the cross-entropy)."""
  from bench.kernels.cases import peers

  good = peers.run_peer(_fake_peer(), "tiny", "cpu", repeats=1, warmup=0)
  assert good.ok and good.parity["ce_sum"] <= 1.0, good
  assert good.kernel.timing.median_s > 0 and good.reference.timing.median_s > 0
  assert good.speedup == pytest.approx(good.reference.timing.median_s / good.kernel.timing.median_s)
  bad = peers.run_peer(_fake_peer(1.01), "tiny", "cpu", repeats=1, warmup=0)
  assert not bad.ok and bad.parity["ce_sum"] > 1.0
