"""The training path's pass count and its cotangent handling (kernels/grpo_loss/vjp.py).

Counted on the traced program (cheap, no lowering): the bytes that kernel calls read or write in
[N, V]-sized arrays, and every other operation that touches one. Two passes = the logits read once
and dlogits written once (2 N V itemsize); a training step that differentiates aux outputs or uses a
sequence-level spec keeps the three-pass backward, checked here too so the dispatch cannot drift.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

import kernels
from bench.tolerances import assert_close
from kernels.grpo_loss import LossBlocks
from kernels.grpo_loss import vjp as loss_vjp
from kernels.grpo_loss.mosaic_gpu_blocks import ClusterLossBlocks, MosaicLossBlocks
from tests.kernels.grpo_loss.test_grpo_loss import make_problem

CALLS = {
  "tiled": dict(impl="pallas", platform="cpu", interpret=True, blocks=LossBlocks(8, 128)),
  "rowloop": dict(impl="pallas", platform="gpu", interpret=True, blocks=LossBlocks(1, 128)),
  "mosaic_gpu": dict(
    impl="mosaic_gpu", platform="gpu", interpret=True, blocks=MosaicLossBlocks(64, 128, 2)
  ),
  # 8 rows x 2 CTAs: the exchange scratch [N / 8, 2, 4, 128] f32 stays under N V (not counted)
  "mosaic_cluster": dict(
    impl="mosaic_gpu", platform="gpu", interpret=True, blocks=ClusterLossBlocks(8, 2, 1024)
  ),
}
# [N, V] bookkeeping XLA does in place or removes: reshapes are bitcasts, and the multiply by the
# constant cotangent 1 (with its converts) is folded by the algebraic simplifier (checked below).
FREE = {"reshape", "convert_element_type"}
KERNELS = {"pallas_call", "mpmd_map"}  # Pallas (Triton, Mosaic TPU, interpreter); plgpu.kernel


def nv_traffic(fn, x):
  """(bytes kernels move in [N, V]-sized arrays, the other eqns that touch one) in fn's jaxpr."""
  size, kernel, others = x.size, [0], []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      big = [
        v for v in (*eqn.invars, *eqn.outvars) if np.prod(getattr(v.aval, "shape", ())) >= size
      ]
      if eqn.primitive.name in KERNELS:
        kernel[0] += sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in big)
        continue
      subs = [
        p for p in eqn.params.values() if isinstance(p, (jax_core.Jaxpr, jax_core.ClosedJaxpr))
      ]
      for sub in subs:
        walk(getattr(sub, "jaxpr", sub))
      if big and not subs:
        others.append(eqn)

  walk(jax.make_jaxpr(fn)(x).jaxpr)
  return kernel[0], others


def assert_only_free(others):
  for eqn in others:
    if eqn.primitive.name == "mul":
      consts = [v.val for v in eqn.invars if isinstance(v, jax_core.Literal)]
      assert consts and float(consts[0]) == 1.0, f"an [N, V] multiply by a non-constant: {eqn}"
    else:
      assert eqn.primitive.name in FREE, f"an extra [N, V] pass: {eqn}"


@pytest.mark.parametrize("family", CALLS)
def test_training_step_reads_logits_once_and_writes_dlogits_once(family):
  """value_and_grad of the loss (aux as has_aux data, the loop's pattern): one kernel reads the
  logits and writes dlogits, nothing else passes over [N, V]. Catches a dispatch that falls back to
  the three-pass backward (a forward kernel + a backward kernel: 3 N V) or an unfolded rescale."""
  args, kw = make_problem(4, 16, 256, jnp.bfloat16, off_policy=True, beta=0.04, seed=3)
  x = args[0]
  f = lambda y: kernels.grpo_loss(y, *args[1:], **kw, **CALLS[family])
  kernel, others = nv_traffic(jax.value_and_grad(f, has_aux=True), x)
  assert kernel == 2 * x.size * x.dtype.itemsize
  assert_only_free(others)


@pytest.mark.parametrize("family", ["tiled", "rowloop", "mosaic_cluster"])
def test_aux_gradients_and_sequence_level_specs_keep_three_passes(family):
  """Differentiating per_token_kl, or a GSPO spec: the backward kernel re-reads the logits (the
  statistics kernel or the training kernel first), so the symbolic-zero dispatch is exercised."""
  args, kw = make_problem(4, 16, 256, jnp.float32, off_policy=True, beta=0.04, seed=3)
  x, nv = args[0], args[0].size * 4
  loss = lambda y, **o: kernels.grpo_loss(y, *args[1:], **kw, **o, **CALLS[family])
  with_aux = lambda y: (lambda out: out[0] + jnp.sum(out[1].per_token_kl))(loss(y))
  assert nv_traffic(jax.grad(with_aux), x)[0] == 4 * nv  # train kernel (2) + backward (2)
  gspo = lambda y: loss(y, importance_sampling_level="sequence")[0]
  assert nv_traffic(jax.grad(gspo), x)[0] == 3 * nv  # statistics (1) + backward (2)


def test_cotangent_one_costs_no_pass_after_xla():
  """The backward's ``dlogits * ct`` with the constant 1 of jax.grad compiles to no arithmetic."""
  d = jnp.ones((64, 256), jnp.bfloat16)
  hlo = jax.jit(lambda a: loss_vjp.apply_cotangent(a, jnp.float32(1.0))).lower(d).compile()
  text = hlo.as_text()
  assert "multiply" not in text and "convert" not in text


@pytest.mark.parametrize("family", ["tiled", "rowloop"])
def test_loss_and_aux_gradients_together_match_reference(family):
  """Both cotangents at once (the three-pass backward adds ct_loss * d loss / d logp to the aux
  cotangent): a backward that drops either one fails."""
  args, kw = make_problem(2, 4, 256, jnp.float32, off_policy=True, beta=0.04, seed=8)
  w = jnp.asarray(np.random.default_rng(9).normal(size=args[1].shape), jnp.float32)

  def grad(**call):
    def f(y):
      loss, aux = kernels.grpo_loss(y, *args[1:], **kw, **call)
      return 0.7 * loss + jnp.sum(w * aux.per_token_logps) - jnp.sum(w * aux.per_token_kl)

    return jax.grad(f)(args[0])

  assert_close(grad(**CALLS[family]), grad(impl="xla"), "grad", jnp.float32, 256, family)


@pytest.mark.parametrize("family", ["tiled", "rowloop"])
def test_loss_scale_is_folded_into_the_forward(family):
  """loss_scale multiplies the loss and its gradient like ``loss * s`` does, with the training path
  still at two passes (the scale rides in the in-kernel weights, the cotangent stays 1); a traced
  ``loss * s`` cotangent is applied correctly too."""
  args, kw = make_problem(3, 5, 256, jnp.float32, off_policy=True, seed=2)
  s = jnp.float32(0.375)

  def run(scale_in, scale_out, **call):
    f = lambda y, s_: kernels.grpo_loss(y, *args[1:], **kw, loss_scale=scale_in, **call)[0]
    return jax.jit(jax.value_and_grad(lambda y, s_: f(y, s_) * scale_out(s_)))(args[0], s)

  ref = run(None, lambda s_: s_, impl="xla")
  for scale_in, scale_out in ((s, lambda s_: 1.0), (None, lambda s_: s_)):
    loss, grad = run(scale_in, scale_out, **CALLS[family])
    np.testing.assert_allclose(loss, ref[0], rtol=1e-6)
    assert_close(grad, ref[1], "grad", jnp.float32, 256, f"{family} loss_scale={scale_in}")
  f = lambda y: kernels.grpo_loss(y, *args[1:], **kw, loss_scale=s, **CALLS[family])[0]
  kernel, others = nv_traffic(jax.grad(f), args[0])
  assert kernel == 2 * args[0].size * 4
  assert_only_free(others)


@pytest.mark.parametrize(
  "value,error",
  [(jnp.ones(2), TypeError), (float("nan"), ValueError), ("x", TypeError)],
)
def test_bad_loss_scale_raises_naming_it(value, error):
  args, kw = make_problem(1, 2, 16, jnp.float32)
  with pytest.raises(error, match="loss_scale"):
    kernels.grpo_loss(*args, **kw, loss_scale=value, **CALLS["tiled"])


def test_launch_budgets_at_the_production_shape():
  """The no-GPU evidence in the kernels' docstrings (kernels/grpo_loss/pallas_blocks.py), at N 8192,
  V 151936, bf16, default blocks: the Triton heuristic keeps enough bytes in flight per SM for 80 %
  of the copy rate (Little's law), fills the GPU many times over, and sweeps few enough rows at once
  for the training kernel's reversed re-read to hit L2 (one HBM read). The Mosaic GPU kernel's
  64-row CTAs fill 128 of 132 SMs with 64 KB in flight, but read the logits twice when training.
  Catches a heuristic change that silently breaks one of these (e.g. 8 warps: two resident rows per
  SM, 80 MB swept > 50 MB of L2)."""
  from kernels import backend
  from kernels.grpo_loss.mosaic_gpu_blocks import default_blocks as mosaic_default
  from kernels.grpo_loss.pallas_blocks import default_blocks, mosaic_budget, rowloop_budget

  n, v = 8192, 151936
  gpu = backend.make_target("gpu", interpret=False)
  r = rowloop_budget(n, v, 2, default_blocks(gpu, n, v))
  assert r.programs == n and r.waves >= 8 and r.bytes_per_program == v * 2
  assert r.in_flight_per_sm >= r.needed_in_flight_per_sm
  assert r.training_reads == 1 and r.swept_rows_bytes <= 50 * 2**20
  assert r.train_ms == pytest.approx(2 * r.fwd_ms) and 1.0 < r.fwd_ms < 1.05  # 2.49 GB at 2.4 TB/s
  crowded = rowloop_budget(n, v, 2, LossBlocks(1, 4096, num_warps=8))
  assert crowded.resident_per_sm == 2 and crowded.training_reads == 2
  m = mosaic_budget(n, v, 2, mosaic_default(jnp.bfloat16))
  assert (m.programs, m.resident_per_sm, m.in_flight_per_sm) == (128, 1, 64 * 1024)
  assert m.training_reads == 2 and m.train_ms == pytest.approx(3 * m.fwd_ms)


def test_split_blocks_validated():
  """splits is a positive int, and a GPU (rowloop) setting: the tiled family has no split kernel."""
  with pytest.raises(ValueError, match="splits"):
    LossBlocks(1, 128, splits=0)
  args, kw = make_problem(1, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match="splits"):
    kernels.grpo_loss(*args, **kw, **dict(CALLS["tiled"], blocks=LossBlocks(8, 128, splits=2)))
