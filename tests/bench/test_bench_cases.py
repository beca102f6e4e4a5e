"""The bench cases through pytest-benchmark: ``pytest tests/bench --benchmark-only``.

Kernel and reference of a case share a benchmark group, so pytest-benchmark prints them side by side
(``--benchmark-autosave`` / ``--benchmark-compare`` track them across runs). The kernel side asserts
parity first: a fast wrong kernel fails instead of timing. The default test run passes
``--benchmark-disable``, which runs each body once as a smoke test, at the harness's tiny size; a
benchmarking run uses the bench's size for the backend (small on CPU, large on an accelerator).
"""

import jax
import numpy as np
import pytest

from bench import harness
from bench.cases import all_cases
from bench.tolerances import parity_error
from kernels import backend

_TARGET = backend.resolve()


def pytest_generate_tests(metafunc):
  if "case" in metafunc.fixturenames:
    timing = not metafunc.config.getoption("benchmark_disable")
    size = ("small" if _TARGET.platform == "cpu" else "large") if timing else "tiny"
    metafunc.parametrize("case", all_cases(size, _TARGET.platform), ids=lambda c: c.name)


@pytest.mark.parametrize("side", ["kernel", "reference"])
def test_bench(benchmark, case, side):
  args = case.make_inputs(0)
  compiled, _ = harness.compile_fn(getattr(case, side), args)
  if side == "kernel":
    ref_out = jax.tree.leaves(jax.jit(case.reference)(*args))
    out = jax.tree.leaves(compiled(*args))
    for c in case.checks:
      err = max(parity_error(np.asarray(out[i]), np.asarray(ref_out[i]), c.quantity, c.dtype, c.reduction_len)
                for i in (c.index if isinstance(c.index, tuple) else (c.index,)))
      assert err <= 1.0, f"{case.name} {c.label}: error {err:.3g}x the tolerance"
  benchmark.group = case.name
  benchmark.extra_info.update(case.params, bytes=case.bytes, interpret=_TARGET.interpret)
  benchmark.pedantic(lambda: jax.block_until_ready(compiled(*args)), warmup_rounds=2, rounds=10)
