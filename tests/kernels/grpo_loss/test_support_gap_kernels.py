"""The support gap inside every grpo_loss kernel's own sweeps (issue 48): each impl (Pallas tiled,
vocab-tiled and rowloop in their interpreters, Mosaic GPU rows and cluster) against the reference
with gaps, on hypothesis shapes with ragged tails, and on hand-built rows whose answer is known.

The gaps are the engines' midpoints (:func:`top_k_gaps`); the hand-built rows put the threshold
exactly on a logit (ties) or where the temperature decides the set.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from bench.tolerances import assert_close
from kernels import backend
from kernels.grpo_loss.mosaic_gpu_blocks import MosaicLossBlocks
from tests.kernels.grpo_loss.test_cluster import blocks_for, needs_cluster_interpreter
from tests.kernels.grpo_loss.test_grpo_loss import FAMILIES, OPTIONS, loss_and_grad, make_problem
from tests.kernels.grpo_loss.test_mosaic_gpu import MIN_BV
from tests.kernels.grpo_loss.test_support_gap import top_k_gaps
from tests.problems import assert_loss_parity


def impl_kw(impl: str, dtype, bn: int = 8, bv: int = 128) -> dict:
  """The call of one kernel impl in its CPU interpreter: a Pallas family or Mosaic GPU's rows."""
  if impl == "mosaic_gpu":
    blocks = MosaicLossBlocks(64, 2 * MIN_BV[jnp.dtype(dtype)], 2)
    return dict(impl="mosaic_gpu", platform="cpu", interpret=True, blocks=blocks)
  platform, blocks = FAMILIES[impl]
  return dict(impl="pallas", platform=platform, interpret=True, blocks=blocks(bn, bv))


IMPLS = (*FAMILIES, "mosaic_gpu")


def gapped(args, kw, seed):
  return dict(kw, support_gap=top_k_gaps(args[0], args[1], kw.get("temperature", 1.0), seed))


def outside_support(args, kw):  # -> [B, T, V] bool: the columns the gap filters out
  z = np.asarray(args[0], np.float64) / kw.get("temperature", 1.0)
  ids = np.asarray(args[1])[..., None]
  thr = np.take_along_axis(z, ids, axis=-1) + np.asarray(kw["support_gap"], np.float64)[..., None]
  return (z < thr) & (np.arange(z.shape[-1]) != ids)


@settings(max_examples=4, deadline=None)
@given(
  b=st.integers(1, 3),
  t=st.integers(1, 5),
  v=st.integers(130, 400),
  bv=st.sampled_from([128, 256]),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  impl=st.sampled_from(sorted(IMPLS)),
  option=st.sampled_from(sorted(OPTIONS)),
  seed=st.integers(0, 2**31 - 1),
)
def test_gapped_parity_ragged_shapes(b, t, v, bv, dtype, impl, option, seed):
  """Catches: a vocabulary tail (V not a multiple of the tile or slab) or a ragged row block gapped
  with the wrong row's threshold, a gap ignored in one sweep (statistics, training or backward), a
  gap applied before the temperature (off_policy_temp / kl run at T 0.7 / 1.3)."""
  args, kw = make_problem(b, t, v, dtype, seed=seed, **OPTIONS[option])
  kw = gapped(args, kw, seed)
  ours = loss_and_grad(args, kw, **impl_kw(impl, dtype, 8, bv))
  ref = loss_and_grad(args, kw, impl="xla")
  assert_loss_parity(ours, ref, args, kw, f"{impl} gaps")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_dlogits_are_zero_outside_the_support(impl, dtype):
  """Catches: a gap ignored in the backward or the training kernel's dlogits sweep (-g p_v written
  over the filtered columns: ~1e-5 each, below bf16's parity tolerance, so checked exactly here),
  and y dropped from its own set (a finite log p~ <= 0 for every token)."""
  args, kw = make_problem(3, 5, 300, dtype, seed=7, **OPTIONS["kl"])
  kw = gapped(args, kw, 7)
  outside = outside_support(args, kw)
  assert outside.sum() > 1000
  for call in (impl_kw(impl, dtype), dict(impl_kw(impl, dtype), loss_type="dr_grpo")):
    _, aux, grad = loss_and_grad(args, kw, **call)
    assert np.all(np.asarray(grad, np.float32)[outside] == 0)
    logp = np.asarray(aux.per_token_logps)
    assert np.all(np.isfinite(logp)) and np.all(logp <= 1e-6)


# one row: z = [3, 2, 2, 2, 1, 0, ...]: the set of y = 0 with gap -1 is {3, 2, 2, 2} (the threshold
# on the tied value, which the sampler keeps); rows 2.. are other tokens' unfiltered rows
def _tie_problem(v=260):
  row = np.concatenate([[3.0, 2.0, 2.0, 2.0, 1.0], np.zeros(v - 5)])
  logits = jnp.asarray(np.tile(row, (1, 3, 1)), jnp.bfloat16)
  ids = jnp.asarray([[0, 1, 4]], jnp.int32)
  gap = jnp.asarray([[-1.0, -jnp.inf, -jnp.inf]], jnp.float32)
  mask, adv = jnp.ones((1, 3), bool), jnp.asarray([1.0], jnp.float32)
  return (logits, ids, mask, adv), dict(support_gap=gap)


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_at_the_kth_logit_are_kept(impl):
  """Catches: a strict comparison (ties with the threshold dropped: the sampler's threshold top-k
  keeps them), and the tie kept in one sweep but not the other (the backward's columns)."""
  args, kw = _tie_problem()
  _, aux, grad = loss_and_grad(args, kw, **impl_kw(impl, jnp.bfloat16))
  expected = 3.0 - np.log(np.exp(3.0) + 3 * np.exp(2.0))
  assert float(aux.per_token_logps[0, 0]) == pytest.approx(expected, rel=1e-5)
  g = np.asarray(grad[0, 0], np.float32)
  assert np.all(g[1:4] != 0) and np.all(g[4:] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_gap_is_applied_after_the_temperature(impl):
  """At T 2 the gap -1.5 keeps z = logits / 2 >= 2 - 1.5: {4, 3, 2} of logits [4, 3, 2, 0, ...];
  a gap applied to the raw logits would keep {4, 3} (log p 0.31 nats away). Catches: the threshold
  formed from unscaled logits or compared with unscaled tiles."""
  row = np.concatenate([[4.0, 3.0, 2.0], np.zeros(257)])
  logits = jnp.asarray(row[None, None], jnp.float32)
  args = (logits, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool), jnp.ones((1,)))
  kw = dict(support_gap=jnp.full((1, 1), -1.5, jnp.float32), temperature=2.0)
  _, aux, _ = loss_and_grad(args, kw, **impl_kw(impl, jnp.float32))
  expected = 2.0 - np.log(np.exp(2.0) + np.exp(1.5) + np.exp(1.0))
  assert float(aux.per_token_logps[0, 0]) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_logit_shift_leaves_every_impl(impl):
  """Catches: a kernel reading the gap as an absolute threshold (a row's constant shift changes its
  S), or a threshold formed from other logits than the kernel's own (shifted) tiles."""
  args, kw = make_problem(3, 5, 300, jnp.float32, seed=8, **OPTIONS["kl"])
  kw = gapped(args, kw, 8)
  shift = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 1)) * 5, jnp.float32)
  a = loss_and_grad(args, kw, **impl_kw(impl, jnp.float32))
  b = loss_and_grad((args[0] + shift, *args[1:]), kw, **impl_kw(impl, jnp.float32))
  assert_close(b[0], a[0], "value", jnp.float32, 300, "loss")
  assert_close(b[2], a[2], "grad", jnp.float32, 300, "dlogits")


@pytest.mark.parametrize("field", ["per_token_logps", "per_token_kl"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gapped_gradient_through_aux(impl, field):
  """The three-pass backward (the differentiable aux outputs) with gaps. Catches: the statistics
  kernel gapped but the backward kernel not (or fed another call's thresholds)."""
  args, kw = make_problem(3, 5, 300, jnp.float32, off_policy=True, beta=0.04, seed=5)
  kw = gapped(args, kw, 5)
  weights = jnp.asarray(np.random.default_rng(6).normal(size=args[1].shape), jnp.float32)

  def grad(**call_kw):
    f = lambda x: jnp.sum(weights * getattr(kernels.grpo_loss(x, *args[1:], **kw, **call_kw)[1], field))  # fmt: skip
    return jax.grad(f)(args[0])

  ours, ref = grad(**impl_kw(impl, jnp.float32)), grad(impl="xla")
  assert float(jnp.max(jnp.abs(ref))) > 0.1
  assert_close(ours, ref, "grad", jnp.float32, 300, f"d {field} / dlogits")
  assert np.all(np.asarray(ours)[outside_support(args, kw)] == 0)


@needs_cluster_interpreter
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cluster_kernels_with_gaps(dtype):
  """Catches: the cluster-split kernels' slices gapped with another row's threshold (the info
  record's column) or not at all."""
  args, kw = make_problem(3, 5, 300, dtype, seed=9, **OPTIONS["kl"])
  kw = gapped(args, kw, 9)
  blocks = blocks_for(dtype, 4, 2)
  call = dict(impl="mosaic_gpu", platform="gpu", interpret=True, blocks=blocks)
  ours, ref = loss_and_grad(args, kw, **call), loss_and_grad(args, kw, impl="xla")
  assert_loss_parity(ours, ref, args, kw, "cluster gaps")


@pytest.mark.parametrize(
  "platform,impl", [("tpu", "pallas"), ("gpu", "pallas"), ("gpu", "mosaic_gpu")]
)
def test_gapped_kernels_lower_for_the_chip(platform, impl):
  """The gapped kernels lower for Mosaic TPU / Triton CUDA / Mosaic GPU (sm_90) from this host, the
  training and statistics kernels with one more [N] input. Catches: a threshold block Mosaic's
  (8, 128) rule refuses, a Triton scalar select it cannot lower, a Mosaic GPU barrier count that
  does not match its copies."""
  b, t, v = 2, 64, 4096
  specs = [
    jax.ShapeDtypeStruct((b, t, v), jnp.bfloat16),
    jax.ShapeDtypeStruct((b, t), jnp.int32),
    jax.ShapeDtypeStruct((b, t), jnp.bool_),
    jax.ShapeDtypeStruct((b,), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.float32),
  ]

  def loss(logits, ids, mask, adv, gap):
    return kernels.grpo_loss(logits, ids, mask, adv, support_gap=gap, impl=impl)[0]

  target = backend.make_target(platform, interpret=False)
  for fn in (loss, jax.grad(loss)):
    with backend.use_target(platform, interpret=False):
      text = jax.jit(fn).trace(*specs).lower(lowering_platforms=(target.lowering_platform,))
    marker = backend.MOSAIC_GPU_MARKER if impl == "mosaic_gpu" else None
    marker = marker or backend.LOWERED_KERNEL_MARKERS[platform]
    assert marker in text.as_text()
