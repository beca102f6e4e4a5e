"""Every TPU kernel through libtpu's real compiler (``nox -s tpu_compile``): each case of
:data:`bench.tpu.compile.CASES` (production shapes, the option sets of test_lowering.py) compiled for
one chip of v4, v5e, v5p, v6e and v7x, and inside a sharded program on a 4-chip v6e slice; then every
TPU candidate the autotuner offers on each generation (after its legality filter), so that
``impl="auto"`` can never pick a kernel that does not compile. A compile error or a missing Mosaic
call fails the test.

Needs the libtpu wheel (``jax[tpu]`` at the project's jax version) and, on a host without a TPU,
``JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (the session sets both); skipped where libtpu is
missing, as in the default CPU run. Nothing executes: the figures are compiled, not measured."""

import pytest

from kernels import tpu_targets

pytestmark = pytest.mark.skipif(
  not tpu_targets.libtpu_available(), reason="needs libtpu (nox -s tpu_compile)"
)

from bench.tpu import compile as tc  # noqa: E402  (after the skip: the cases need no libtpu to import)


@pytest.mark.parametrize("generation", tc.GENERATIONS)
@pytest.mark.parametrize("case", tc.CASES, ids=lambda c: c.name)
def test_kernel_compiles_on_one_chip(case, generation):
  """Catches: a VMEM overflow on a generation the heuristic was not sized for (v4's 16 MiB), a
  Mosaic layout the kernel body asks for and the compiler cannot do (the fused head's mask), a
  kernel silently replaced (the count of Mosaic calls)."""
  r = tc.compile_case(case, generation)
  assert r.ok, f"{case.name} on {generation}: {r.error}"
  expected = case.kernels_for(generation)
  assert r.kernels == expected, f"{r.kernels} Mosaic calls, expected {expected}"


@pytest.mark.parametrize("case", tc.CASES, ids=lambda c: c.name)
def test_kernel_compiles_inside_a_sharded_program(case):
  """Inputs sharded over a 4-chip v6e mesh (batch over dp x fsdp, the head's V or the kv heads over
  tp): catches a pallas_call outside a shard_map ("Mosaic kernels cannot be automatically
  partitioned") and specs that do not match the mesh."""
  r = tc.compile_case(case, None, sharded=True)
  assert r.ok, f"{case.name} sharded on {tc.SHARDED_SLICE}: {r.error}"
  assert r.kernels == case.kernels, f"{r.kernels} Mosaic calls, expected {case.kernels}"


@pytest.mark.parametrize("generation", tc.GENERATIONS)
def test_every_tuner_candidate_auto_can_pick_compiles(generation):
  """bench.tune's TPU grid after its per-generation legality filter (kernels' legal_on): catches a
  candidate that passes the filter but cannot compile there, which a tune would record as an error
  at best and, with a looser parity gate, install for impl="auto"."""
  cands = tc.tuner_candidates(generation)
  assert cands, "the legality filter left no candidate beyond the heuristic's"
  failed = []
  for name, cand, problem in cands:
    r = tc.compile_candidate(name, cand, problem, generation)
    if not r.ok or r.kernels < 1:
      failed.append(f"{name}: {r.error or 'no Mosaic call'}")
  assert not failed, "\n".join(failed)
