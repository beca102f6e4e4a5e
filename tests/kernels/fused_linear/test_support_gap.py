"""``fused_linear_grpo_loss(..., support_gap=)`` in every impl: each token scored over the set its
sampler drew it from (:mod:`kernels.support`), values and both gradients equal to the reference's.

The fused kernels never hold a row of logits: each row's threshold z'_y + g is formed first from the
head's chosen column (:mod:`kernels.fused_linear.gap`) and every logits tile of every sweep applies it.
The problems (:mod:`.gap_problems`) draw half the ids from each row's top 5 and cut a top-k set at the
midpoint of two logits (as the engines report it), so S is a few columns for many tokens: a sweep that
ignores the gap, or applies it to the raw logits, fails the parity checks here. Shapes are tiny and
the compiled functions few (CI's fused parity tests are already among its slowest).
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import kernels
from bench.tolerances import assert_close
from kernels.fused_linear import LinearBlocks, MosaicLinearBlocks
from rl.sharding import make_mesh
from tests.kernels.fused_linear.gap_problems import gap_problem
from tests.kernels.fused_linear.test_fused_linear import (
  OPTIONS,
  PATHS,
  assert_parity,
  reference,
  value_and_grads,
)

KL_TEMP = OPTIONS["off_policy_kl_temp"]  # off-policy, KL (beta 0.04), temperature 0.8
BLOCKS = LinearBlocks(8, 128, 16)  # several row, vocabulary and hidden tiles at V = 300, H = 32


def _call(impl, platform, **kw):
  blocks = BLOCKS if impl == "pallas" else None
  return dict(impl=impl, platform=platform, interpret=True, blocks=blocks, chunk_size=4, **kw)


@pytest.mark.parametrize("impl,platform", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gapped_parity(impl, platform, dtype):
  """Values, log-probs, entropy, KL and both gradients equal the reference's with gaps. Catches: a
  gap ignored in the statistics sweep (log-probs over the full softmax) or in the gradient sweep
  (dhidden / dlm_head spreading -p over filtered columns), y dropped from its own set, the gap
  applied before the temperature (T 0.8 here), a chunked path that masks only its first chunk."""
  args, kw = gap_problem(2, 9, 32, 300, dtype, KL_TEMP, seed=3)
  assert_parity(args, kw, impl, platform, blocks=BLOCKS if impl == "pallas" else None, chunk_size=4)


def test_mosaic_gpu_gapped_parity():
  """The Mosaic GPU kernels in their interpreter (one call: ~10-20 s), N = 70, H = 128, V = 300 in
  64-wide tiles over 2 splits: the statistics kernel's tiles, the first two tiles' stored exp(z - m)
  and the dlogits chunks over the other 172 columns. Catches: the gap ignored in either kernel or
  in the stored tiles' dl, a threshold read from another row's shared-memory slot."""
  args, kw = gap_problem(2, 35, 128, 300, jnp.bfloat16, KL_TEMP, seed=1)
  blocks = MosaicLinearBlocks(64, 64, 64, 2, 2, 128, stored_cols=128)
  assert_parity(args, kw, "mosaic_gpu", "cpu", blocks=blocks)


@settings(max_examples=3)
@given(
  b=st.integers(1, 2),
  t=st.integers(1, 7),
  v=st.integers(2, 400),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  path=st.sampled_from(PATHS),
  seed=st.integers(0, 2**31),
)
def test_gapped_parity_hypothesis(b, t, v, dtype, path, seed):
  """Ragged N (a partial row block), ragged V (a vocabulary tile past V, a vocabulary under one
  tile), masks and empty rows, both dtypes: the threshold and the tail masks together."""
  args, kw = gap_problem(b, t, 32, v, dtype, KL_TEMP, seed=seed)
  assert_parity(args, kw, *path, blocks=BLOCKS if path[0] == "pallas" else None, chunk_size=3)


def test_gaps_change_the_result():
  """Catches: a test above that cannot fail (gaps so loose that S is the whole vocabulary)."""
  args, kw = gap_problem(2, 9, 32, 300, "float32", KL_TEMP, seed=3)
  gapped = kernels.fused_linear_grpo_loss(*args, **kw, impl="xla")[1].per_token_logps
  plain = kernels.fused_linear_grpo_loss(*args, **dict(kw, support_gap=None), impl="xla")[1]
  d = np.abs(np.asarray(gapped - plain.per_token_logps))[np.asarray(args[3])]
  assert d.max() > 0.3 and (d > 1e-3).mean() > 0.2


@pytest.mark.parametrize("impl,platform", PATHS)
def test_neg_inf_gaps_are_the_plain_loss(impl, platform):
  """All gaps -inf (nothing filtered): exactly the ungapped call, finite. Catches: -inf thresholds
  making NaN (-inf - -inf, 0 * inf in the entropy) or moving anything."""
  args, kw = gap_problem(2, 5, 32, 200, "float32", KL_TEMP, seed=4)
  loose = dict(kw, support_gap=jnp.full(args[2].shape, -jnp.inf, jnp.float32))
  ours = value_and_grads(kernels.fused_linear_grpo_loss, args, loose, **_call(impl, platform))
  plain = value_and_grads(
    kernels.fused_linear_grpo_loss, args, dict(kw, support_gap=None), **_call(impl, platform)
  )
  # another program (the thresholds' select fused differently): equal to rounding, not bitwise
  (value, aux, (dh, dw)), (p_value, p_aux, (p_dh, p_dw)) = ours, plain
  for a in jax.tree.leaves(ours):
    assert np.isfinite(np.asarray(a, np.float32)).all()
  assert_close(value, p_value, "value", jnp.float32, 232, impl, scale=1.0)
  for name in ("per_token_logps", "entropy", "per_token_kl"):
    assert_close(getattr(aux, name), getattr(p_aux, name), "value", jnp.float32, 232, name, scale=10.0)  # fmt: skip
  assert_close(dh, p_dh, "grad", jnp.float32, 232, f"{impl} dhidden")
  assert_close(dw, p_dw, "grad", jnp.float32, 42, f"{impl} dlm_head")


def test_a_logit_shift_leaves_the_result():
  """Each row's logits shifted by its own constant (an extra hidden unit of value c_n over a head
  row of ones): the same S, loss and log-probs. Catches: a gap read as an absolute threshold, or a
  threshold formed from the unshifted (or another row's) chosen logit."""
  args, kw = gap_problem(2, 6, 32, 200, "float32", KL_TEMP, seed=5)
  b, t, _ = args[0].shape
  shift = np.random.default_rng(0).normal(size=(b, t, 1)).astype(np.float32) * 5
  # 16 more hidden units (one hidden tile): the shift, then zeros
  extra = np.concatenate([shift, np.zeros((b, t, 15), np.float32)], axis=-1)
  rows = np.zeros((16, args[1].shape[1]), np.float32)
  rows[0] = 1.0
  h = jnp.concatenate([args[0], jnp.asarray(extra)], axis=-1)
  w = jnp.concatenate([args[1], jnp.asarray(rows)], axis=0)
  base = kernels.fused_linear_grpo_loss(*args, **kw, **_call("pallas", "cpu"))
  moved = kernels.fused_linear_grpo_loss(h, w, *args[2:], **kw, **_call("pallas", "cpu"))
  assert_close(moved[0], base[0], "value", jnp.float32, 233, "loss", scale=1.0)
  logp = np.asarray(base[1].per_token_logps)
  assert_close(moved[1].per_token_logps, logp, "value", jnp.float32, 233, "logp", scale=10.0)


@pytest.mark.parametrize("impl,platform", PATHS[:2])
def test_vocab_sharded_gaps_equal_unsharded(impl, platform):
  """tp = 2: each shard sees its own columns and shard-local ids, the threshold is the row's (from
  the whole head). Catches: a threshold formed from a shard's own chosen column (0 where y is on
  the other shard), or y's hit tested with global ids against shard-local columns."""
  args, kw = gap_problem(2, 6, 32, 512, "float32", KL_TEMP, seed=6)
  mesh = make_mesh(dp=1, fsdp=4, tp=2)
  call = _call(impl, platform)
  sharded = jax.jit(
    lambda h, w: value_and_grads(
      kernels.fused_linear_grpo_loss, (h, w, *args[2:]), kw, mesh=mesh, vocab_axis="tp", **call
    )
  )(*args[:2])
  r_value, r_aux, (r_dh, r_dw) = reference(args, kw)
  assert_close(sharded[0], r_value, "value", jnp.float32, 544, impl, scale=max(1.0, abs(float(r_value))))  # fmt: skip
  assert_close(sharded[1].per_token_logps, r_aux.per_token_logps, "value", jnp.float32, 544, impl, scale=10.0)  # fmt: skip
  assert_close(sharded[2][0], r_dh, "grad", jnp.float32, 544, f"{impl} dhidden")
  assert_close(sharded[2][1], r_dw, "grad", jnp.float32, 44, f"{impl} dlm_head")
