"""The cluster-split Mosaic GPU loss (impl="mosaic_gpu", blocks=ClusterLossBlocks): parity against the
reference in the Mosaic GPU interpreter, the exact combination of slice partials, bad blocks.

What runs where: the partials travel through a global-memory scratch between two sides of a cluster
barrier (mosaic_gpu_cluster._exchange), the same code in jax 0.11's interpreter as on the GPU. jax
0.10's interpreter has no cluster barriers ("NotImplementedError: nan + cluster_barrier" when it
allocates one), so there only C = 1 runs (no exchange: the per-CTA math, the bulk copies, the
in-shared-memory dlogits). Register layouts are checked by the CUDA lowering
(tests/kernels/test_lowering.py), and everything on hardware by the `gpu` test below.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from bench.tolerances import assert_close
from kernels import backend, lse
from kernels.grpo_loss import mosaic_gpu_blocks as mb
from kernels.grpo_loss import mosaic_gpu_cluster as mc
from kernels.grpo_loss.mosaic_gpu_blocks import ClusterLossBlocks
from tests.kernels.grpo_loss.test_grpo_loss import OPTIONS, loss_and_grad, make_problem
from tests.kernels.grpo_loss.test_options import options_problem
from tests.problems import assert_loss_parity

CLUSTER_INTERPRETER = backend.JAX_VERSION >= (0, 11)
needs_cluster_interpreter = pytest.mark.skipif(
  not CLUSTER_INTERPRETER,
  reason="jax 0.10's Mosaic GPU interpreter cannot allocate a ClusterBarrier (cluster_barrier)",
)
CHUNK = {jnp.dtype(jnp.float32): 512, jnp.dtype(jnp.bfloat16): 1024}  # 128 threads x 16 bytes


def blocks_for(dtype, rows, cluster):
  return ClusterLossBlocks(rows, cluster, CHUNK[jnp.dtype(dtype)])


def assert_parity(args, kw, blocks, loss_types=("grpo",)):
  for loss_type in loss_types:
    call = dict(impl="mosaic_gpu", platform="gpu", interpret=True, blocks=blocks)
    ours = loss_and_grad(args, kw, loss_type=loss_type, **call)
    ref = loss_and_grad(args, kw, loss_type=loss_type, impl="xla")
    assert_loss_parity(ours, ref, args, kw, f"{loss_type} cluster {blocks}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", ["on_policy", "kl"])
def test_single_cta_parity(dtype, option):
  """C = 1 (both jax versions): 7 tokens in row groups of 4 (a padded row), V 300 not a whole number
  of 128-byte units (a padded, masked tail), a chunk wider than the row. Catches a wrong column
  mask, a dlogits overwrite that misses the slice, or a coefficient fed the wrong token record."""
  args, kw = make_problem(1, 7, 300, dtype, seed=2, **OPTIONS[option])
  assert_parity(args, kw, blocks_for(dtype, 4, 1))


@needs_cluster_interpreter
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cluster_parity(dtype):
  """C = 2 over 4 row groups, V 300 (the last CTA's slice is narrower, then padded): catches a
  combine that drops a peer's partials, the last CTA's slice width applied to the others, or a
  dlogits slice stored at the wrong column offset."""
  args, kw = make_problem(2, 7, 300, dtype, seed=5, **OPTIONS["off_policy_temp"])
  assert_parity(args, kw, blocks_for(dtype, 4, 2), loss_types=("grpo", "dr_grpo"))


@needs_cluster_interpreter
def test_cluster_of_four_parity():
  """C = 4 (f32 V 300: slices of 96 and 32 columns, the last CTA's narrower) over 2-row groups.
  Not 4 rows: jax 0.11.2's interpreter hangs on the training kernel at C = 4 with 4 rows (it runs
  C = 4 with 1-2 rows, C = 2 with 4 rows, and the C = 4, 4-row forward); not diagnosed."""
  args, kw = make_problem(1, 6, 300, jnp.float32, seed=9, **OPTIONS["kl"])
  assert_parity(args, kw, blocks_for(jnp.float32, 2, 4))


@pytest.mark.slow
@settings(max_examples=10)
@given(
  t=st.integers(1, 12),
  v=st.integers(1, 400),
  rows=st.sampled_from([1, 2, 4]),
  cluster=st.sampled_from([1, 2] if CLUSTER_INTERPRETER else [1]),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  option=st.sampled_from(sorted(OPTIONS)),
)
def test_parity_ragged_shapes(t, v, rows, cluster, dtype, option):
  """Hypothesis shapes (~6 s an example in the interpreter: slow): token counts that leave padded
  rows, vocabularies smaller than one CTA's unit, slices padded so the last CTA keeps columns."""
  args, kw = make_problem(2, t, v, dtype, seed=t * v, **OPTIONS[option])
  assert_parity(args, kw, blocks_for(dtype, rows, cluster))


@needs_cluster_interpreter
def test_cluster_parity_sequence_options_and_aux_gradient():
  """GSPO (sequence level: the cluster statistics kernel, then the row backward kernel) and an aux
  cotangent (the three-pass branch of the two-pass VJP): the cluster kernel's lse must be the one
  the backward expects."""
  args, kw = options_problem(2, 5, 200, jnp.float32, "mis_sequence_gspo", seed=4)
  assert_parity(args, kw, blocks_for(jnp.float32, 2, 2))
  args, kw = make_problem(1, 6, 96, jnp.float32, off_policy=True, beta=0.04, seed=3)
  w = jnp.asarray(np.random.default_rng(7).normal(size=args[1].shape), jnp.float32)

  def grad(**call):
    def f(x):
      loss, aux = kernels.grpo_loss(x, *args[1:], **kw, **call)
      return 0.5 * loss + jnp.sum(w * aux.per_token_kl) - jnp.sum(w * aux.per_token_logps)

    return jax.grad(f)(args[0])

  blocks = blocks_for(jnp.float32, 2, 2)
  ours = grad(impl="mosaic_gpu", platform="gpu", interpret=True, blocks=blocks)
  assert_close(ours, grad(impl="xla"), "grad", jnp.float32, 96, "cluster aux + loss")


@needs_cluster_interpreter
def test_minus_inf_slice_gives_no_nan():
  """A vocabulary mask of -inf covering all of CTA 1's slice for some rows (its partial max stays
  NEG_BIG, its sum-exp 0): the combine must give those rows finite values and gradients, not the
  NaN of inf - inf."""
  args, kw = make_problem(1, 4, 256, jnp.float32, seed=6, empty_row=False)
  logits = args[0].at[0, :2, 128:].set(-jnp.inf).at[0, 2, ::3].set(-jnp.inf)
  ids = args[1].at[0, :2].set(5)
  args = (logits, ids) + tuple(args[2:])
  blocks = blocks_for(jnp.float32, 4, 2)
  call = dict(impl="mosaic_gpu", platform="gpu", interpret=True, blocks=blocks)
  loss, aux, grad = loss_and_grad(args, kw, **call)
  assert np.isfinite(loss) and np.isfinite(np.asarray(grad)).all()
  assert np.isfinite(np.asarray(aux.per_token_logps)).all()
  # the shared parity helper scales by max |logits| (inf here): compare on finite scales instead
  ref = loss_and_grad(args, kw, impl="xla")
  assert_close(loss, ref[0], "value", jnp.float32, 256, "loss", scale=1.0)
  assert_close(aux.per_token_logps, ref[1].per_token_logps, "value", jnp.float32, 256, "logp", scale=10.0)  # fmt: skip
  assert_close(grad, ref[2], "grad", jnp.float32, 256, "dlogits")


def _slice_partials(z, lo, hi):
  """A CTA's (max, sum-exp, entropy sum about its max, chosen z) of z[lo:hi], as the kernel."""
  s = z[lo:hi]
  m = jnp.maximum(jnp.max(s), lse.NEG_BIG)
  p = jnp.exp(s - m)
  ent = jnp.sum(jnp.where(p == 0, 0.0, p * (s - m)))
  return m, jnp.sum(p), ent


@pytest.mark.parametrize("cluster", [2, 3, 8])
def test_combine_is_exact(cluster):
  """The log-sum-exp of log-sum-exps (no interpreter): C slices' partials, one of them all -inf,
  combine to the row's lse and entropy. Catches a missing rescale of a slice's entropy sum or a
  max taken over only the first slices."""
  z = jnp.asarray(np.random.default_rng(1).normal(size=96) * 4, jnp.float32)
  z = z.at[: 96 // cluster].set(-jnp.inf)  # slice 0 all -inf
  bounds = np.linspace(0, 96, cluster + 1).astype(int)
  parts = [(*_slice_partials(z, lo, hi), jnp.float32(0)) for lo, hi in itertools.pairwise(bounds)]
  m, l, s, _ = mc._combine(parts)
  lse = jax.nn.logsumexp(z)
  p = jax.nn.softmax(z)
  ent = -jnp.sum(jnp.where(p == 0, 0.0, p * (z - lse)))
  np.testing.assert_allclose(m + jnp.log(l), lse, rtol=1e-6)
  np.testing.assert_allclose(jnp.log(l) - s / l, ent, rtol=1e-5, atol=1e-6)


def test_slices_cover_the_vocabulary_in_bulk_copy_units():
  """Production vocabularies split without padding (the wrapper would copy the logits); every
  slice is whole 128-byte units and the last CTA keeps columns."""
  for v in (151936, 128256):
    vp, vc, last = mb.slice_cols(ClusterLossBlocks(4, 8), jnp.bfloat16, v)
    assert vp == v and vc * 2 % 128 == 0 and last * 2 % 128 == 0 and 0 < last <= vc
  vp, vc, last = mb.slice_cols(ClusterLossBlocks(1, 4), jnp.float32, 70)
  assert vp % 32 == 0 and 3 * vc + last == vp and last > 0


def test_launch_budget_reads_the_logits_once():
  """The evidence model at the production shapes: the default blocks fit two CTAs per SM, keep more
  bytes in flight per SM than Little's law asks, and the training path is one read + one write
  (the row kernel's is two reads: its 64-row CTAs outgrow L2 between sweeps). Catches a default
  that no longer fits shared memory or a budget that counts the second sweep."""
  from kernels.grpo_loss.mosaic_gpu_blocks import default_blocks as row_blocks
  from kernels.grpo_loss.pallas_blocks import mosaic_budget

  for v in (151936, 128256):
    blocks = mb.default_cluster_blocks(jnp.bfloat16, v)
    assert 2 * mb.smem_bytes(blocks, jnp.bfloat16, v) <= 227 * 1024
    b = mc.cluster_budget(8192, v, 2, blocks)
    assert b.programs == 8192 // blocks.rows * blocks.cluster and b.resident_per_sm >= 2
    assert b.in_flight_per_sm >= b.needed_in_flight_per_sm
    assert b.training_reads == 1 and b.train_ms == pytest.approx(2 * b.fwd_ms)
    assert mosaic_budget(8192, v, 2, row_blocks(jnp.bfloat16)).training_reads == 2


@pytest.mark.parametrize(
  "blocks,match",
  [
    (lambda: ClusterLossBlocks(4, 16), "cluster must be in"),
    (lambda: ClusterLossBlocks(0, 2), "positive int"),
    (lambda: ClusterLossBlocks(4, 2, 1000), "multiple of 1024"),
    (lambda: ClusterLossBlocks(33, 1, 1024), "rows must be in"),
    (lambda: ClusterLossBlocks(32, 1, 1024), "shared memory"),
  ],
)
def test_bad_blocks_raise_before_lowering(blocks, match):
  args, kw = make_problem(1, 2, 4096, jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    kernels.grpo_loss(*args, impl="mosaic_gpu", platform="gpu", interpret=True, blocks=blocks(), **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(backend.host_platform() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("vocab", [151936, 128256])
def test_parity_on_gpu_production_vocab(vocab):
  """On hardware: the cluster barrier's ordering of the exchange, the strided register layouts,
  the bulk copies."""
  for dtype in (jnp.bfloat16, jnp.float32):
    args, kw = make_problem(4, 64, vocab, dtype, off_policy=True, beta=0.04, seed=0)
    blocks = mb.default_cluster_blocks(dtype, vocab)
    call = dict(impl="mosaic_gpu", platform="gpu", interpret=False, blocks=blocks)
    ours = loss_and_grad(args, kw, **call)
    assert_loss_parity(ours, loss_and_grad(args, kw, impl="xla"), args, kw, f"gpu {blocks}")
