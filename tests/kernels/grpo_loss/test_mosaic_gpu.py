"""Parity of the Mosaic GPU GRPO loss (impl="mosaic_gpu") against the reference, run on CPU through the
Mosaic GPU interpreter (simulated shared memory, TMA copies and barriers), and on a GPU when there is one.

What the interpreter does not check (so the `gpu`-marked test below does, on hardware): register
layouts (``plgpu.layout_cast`` is the identity there) and the real TMA / swizzle; the AOT lowering in
tests/kernels/test_lowering.py checks that the layouts and transfers are legal for sm_90.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import kernels
from bench.tolerances import assert_close
from kernels import backend
from kernels.grpo_loss.mosaic_gpu_blocks import MosaicLossBlocks, default_blocks
from kernels.grpo_loss.reference import LOSS_TYPES
from tests.kernels.grpo_loss.test_grpo_loss import OPTIONS, loss_and_grad, make_problem
from tests.kernels.grpo_loss.test_options import options_problem
from tests.problems import SHAPE_SEARCH_ON_GPU_JAX, assert_loss_parity

# Smallest legal vocab tile per dtype: 128 bytes (the swizzle width).
MIN_BV = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 64}


def assert_parity(args, kw, *, blocks, platform="cpu", interpret=True, loss_types=LOSS_TYPES):
  for loss_type in loss_types:
    ours = loss_and_grad(
      args,
      kw,
      loss_type=loss_type,
      impl="mosaic_gpu",
      platform=platform,
      interpret=interpret,
      blocks=blocks,
    )
    ref = loss_and_grad(args, kw, loss_type=loss_type, impl="xla")
    assert_loss_parity(ours, ref, args, kw, f"{loss_type} mosaic_gpu {blocks}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
def test_parity_every_loss_type(dtype, option):
  """3 x 5 tokens (padded to one 64-row CTA) over V = 300: several pipelined tiles and a masked tail."""
  args, kw = make_problem(3, 5, 300, dtype, **OPTIONS[option])
  assert_parity(args, kw, blocks=MosaicLossBlocks(64, 2 * MIN_BV[jnp.dtype(dtype)], 2))


@SHAPE_SEARCH_ON_GPU_JAX
@given(
  b=st.integers(1, 4),
  t=st.integers(1, 40),
  v=st.integers(1, 500),
  bv_mult=st.integers(1, 3),
  stages=st.integers(1, 4),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  option=st.sampled_from(sorted(OPTIONS)),
  loss_type=st.sampled_from(LOSS_TYPES),
)
def test_parity_ragged_shapes(b, t, v, bv_mult, stages, dtype, option, loss_type):
  """Rows past one CTA (b * t > 64), a vocabulary smaller than one tile, fewer tiles than stages."""
  args, kw = make_problem(b, t, v, dtype, **OPTIONS[option])
  blocks = MosaicLossBlocks(64, bv_mult * MIN_BV[jnp.dtype(dtype)], stages)
  assert_parity(args, kw, blocks=blocks, loss_types=(loss_type,))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
  "option", ["mis_sequence_gspo", "dual_clip_seq_trunc", "gspo_on_policy_kl"]
)
def test_parity_loss_spec_options(dtype, option):
  """The LossSpec options (the shared [B, T] objective on the kernel's logp): values, aux and dlogits
  for every loss type, over several pipelined tiles."""
  args, kw = options_problem(3, 5, 300, dtype, option, seed=4)
  assert_parity(args, kw, blocks=MosaicLossBlocks(64, 2 * MIN_BV[jnp.dtype(dtype)], 2))


def test_default_blocks_fit_and_are_legal():
  for dtype in (jnp.float32, jnp.bfloat16):
    default_blocks(dtype).check(dtype)
  args, kw = make_problem(2, 3, 200, jnp.bfloat16, off_policy=True, beta=0.04)
  assert_parity(args, kw, blocks=None, loss_types=("grpo",))


def test_out_of_range_id_poisons_under_jit():
  """An unmasked id outside [0, V) is NaN (as in the Triton kernel), not a silently wrong loss."""
  args, _ = make_problem(1, 4, 100, jnp.float32, empty_row=False)
  logits, ids, mask, adv = args
  bad = ids.at[0, 1].set(100)
  mask = jnp.ones_like(mask)
  f = jax.jit(
    lambda i: kernels.grpo_loss(logits, i, mask, adv, impl="mosaic_gpu", platform="cpu")[0]
  )
  assert np.isnan(f(bad))
  assert np.isfinite(f(ids))


def aux_and_loss_grad(args, kw, **call):
  w = jnp.asarray(np.random.default_rng(7).normal(size=args[1].shape), jnp.float32)

  def f(x):
    loss, aux = kernels.grpo_loss(x, *args[1:], **kw, **call)
    return 0.5 * loss + jnp.sum(w * aux.per_token_kl) - jnp.sum(w * aux.per_token_logps)

  return jax.grad(f)(args[0])


def test_gradient_through_aux_and_loss_matches_reference():
  """Differentiating aux outputs takes the three-pass branch of the custom VJP (the training kernel's
  dlogits unused, the backward kernel fed ct_loss * d loss / d logp + the aux cotangents): a branch
  that drops either cotangent, or mis-pads the backward, fails."""
  args, kw = make_problem(1, 6, 96, jnp.float32, off_policy=True, beta=0.04, seed=3)
  blocks = MosaicLossBlocks(64, 64, 2)  # two tiles, the second half padding
  ours = aux_and_loss_grad(args, kw, impl="mosaic_gpu", platform="cpu", blocks=blocks)
  ref = aux_and_loss_grad(args, kw, impl="xla")
  assert_close(ours, ref, "grad", jnp.float32, 96, "mosaic_gpu aux + loss")


@pytest.mark.parametrize(
  "call_kw,error,match",
  [
    (dict(blocks=MosaicLossBlocks(32, 64)), ValueError, "block_n must be a multiple of 64"),
    (dict(blocks=MosaicLossBlocks(64, 48)), ValueError, "multiple of 128 bytes"),
    (dict(blocks=MosaicLossBlocks(64, 1024, 4)), ValueError, "shared memory"),
    (dict(blocks=kernels.LossBlocks(1, 128)), TypeError, "MosaicLossBlocks"),
    (dict(reuse_logits_buffer=True), ValueError, "reuse_logits_buffer"),
    (dict(platform="tpu", interpret=False), ValueError, "GPU kernel"),
  ],
)
def test_bad_settings_raise_before_lowering(call_kw, error, match):
  args, kw = make_problem(1, 2, 64, jnp.bfloat16)
  call = dict(dict(platform="cpu"), **call_kw)
  with pytest.raises(error, match=match):
    kernels.grpo_loss(*args, impl="mosaic_gpu", **kw, **call)


@pytest.mark.gpu
@pytest.mark.skipif(backend.host_platform() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("vocab", [151936, 128256])
def test_parity_on_gpu_production_vocab(vocab):
  """On hardware: register layouts, swizzled TMA tiles, barriers (all untested by the interpreter)."""
  for dtype in (jnp.bfloat16, jnp.float32):
    args, kw = make_problem(4, 64, vocab, dtype, off_policy=True, beta=0.04, seed=0)
    assert_parity(args, kw, blocks=None, platform="gpu", interpret=False)
  # the three-pass branch (aux cotangents) on hardware too
  args, kw = make_problem(4, 64, vocab, jnp.float32, off_policy=True, beta=0.04, seed=1)
  ours = aux_and_loss_grad(args, kw, impl="mosaic_gpu", platform="gpu", interpret=False)
  assert_close(ours, aux_and_loss_grad(args, kw, impl="xla"), "grad", jnp.float32, vocab, "aux")
