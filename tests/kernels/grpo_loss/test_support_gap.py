"""``grpo_loss(..., support_gap=)``: every impl scores each token over the set it was sampled from
(:mod:`kernels.support`), values and gradients equal to the reference's.

The gaps come from a real top-k filter on the same logits (k drawn per token, ties at the k-th value
kept), a third of the tokens unfiltered (-inf), so a kernel that ignores the gap in its forward or its
backward, drops y from its own set, or applies the gap before the temperature fails here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from tests.kernels.grpo_loss.test_grpo_loss import FAMILIES, OPTIONS, loss_and_grad, make_problem
from tests.kernels.grpo_loss.test_mosaic_gpu import MIN_BV
from tests.problems import assert_loss_parity


def top_k_gaps(logits, ids, temperature: float, seed: int):  # -> [B, T] f32 <= 0 or -inf
  """The gap a top-k sampler (k in [1, 20] per token) reports for each id, as the engines do
  (``rl.rollout.sampling.gap_of``): the midpoint between the smallest kept z (ties with it kept)
  and the largest dropped one, minus z_y; an id below the k-th value gets the set {z >= z_y} (a
  sampler never draws outside its set, but an off-policy token's gap must stay <= 0); -inf where
  nothing is dropped, and for a third of the tokens (unfiltered)."""
  rng = np.random.default_rng(seed)
  z = np.asarray(logits, np.float32).astype(np.float64) / temperature
  b, t, v = z.shape
  k = rng.integers(1, min(20, v) + 1, size=(b, t))
  kth = np.take_along_axis(-np.sort(-z, axis=-1), (k - 1)[..., None], axis=-1)[..., 0]
  zy = np.take_along_axis(z, np.asarray(ids)[..., None], axis=-1)[..., 0]
  low = np.minimum(kth, zy)  # the smallest kept z
  below = np.where(z < low[..., None], z, -np.inf).max(axis=-1)  # the largest dropped z
  gap = np.where(np.isfinite(below), (low + below) / 2 - zy, -np.inf)
  gap[rng.random((b, t)) < 1 / 3] = -np.inf
  return jnp.asarray(gap, jnp.float32)


def gap_problem(dtype, option: str, seed: int = 3, v: int = 300):
  args, kw = make_problem(3, 5, v, dtype, seed=seed, **OPTIONS[option])
  kw = dict(kw, support_gap=top_k_gaps(args[0], args[1], kw.get("temperature", 1.0), seed))
  return args, kw


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", ["on_policy", "kl"])
def test_pallas_with_gaps_equals_the_reference(family, dtype, option):
  """Catches: a kernel impl that ignores the gap (forward or backward) or applies it to the raw
  logits instead of logits / temperature (kl runs at T 1.3, off-policy, with the KL term)."""
  platform, blocks = FAMILIES[family]
  args, kw = gap_problem(dtype, option)
  ours = loss_and_grad(
    args, kw, impl="pallas", platform=platform, interpret=True, blocks=blocks(8, 128)
  )
  ref = loss_and_grad(args, kw, impl="xla")
  assert_loss_parity(ours, ref, args, kw, f"{family} gaps")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_gpu_with_gaps_equals_the_reference(dtype):
  """Catches: the Hopper kernel impl scoring over the full softmax when a gap is given."""
  from kernels.grpo_loss.mosaic_gpu_blocks import MosaicLossBlocks

  args, kw = gap_problem(dtype, "kl")
  blocks = MosaicLossBlocks(64, 2 * MIN_BV[jnp.dtype(dtype)], 2)
  ours = loss_and_grad(args, kw, impl="mosaic_gpu", platform="cpu", interpret=True, blocks=blocks)
  ref = loss_and_grad(args, kw, impl="xla")
  assert_loss_parity(ours, ref, args, kw, "mosaic_gpu gaps")


def test_gaps_change_the_loss_and_the_gradient():
  """Catches: a test above that cannot fail (gaps so loose that S is the whole vocabulary)."""
  args, kw = gap_problem(jnp.float32, "kl")
  with_gap = loss_and_grad(args, kw, impl="xla")
  without = loss_and_grad(args, dict(kw, support_gap=None), impl="xla")
  mask = np.asarray(args[2])
  dlogp = np.abs(np.asarray(with_gap[1].per_token_logps) - np.asarray(without[1].per_token_logps))
  # random (mostly low-ranked) ids keep S = {v : z_v >= z_y}, large; the top-ranked ones lose most
  assert dlogp[mask].mean() > 0.05 and dlogp[mask].max() > 0.3
  assert float(jnp.max(jnp.abs(with_gap[2] - without[2]))) > 1e-2


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_neg_inf_gaps_are_the_full_softmax(impl):
  """Catches: -inf gaps making NaN (-inf + -inf thresholds, 0 * inf) or moving anything.

  The reference is bit for bit its ungapped self; a kernel gaps its tiles in-kernel, whose select
  (identity at a -inf threshold) may change how XLA:CPU contracts ``x / T - m`` around it in the
  interpreter (one ulp of dlogits): the kernels are held to the tolerance table instead."""
  args, kw = make_problem(3, 5, 300, jnp.float32, seed=4, **OPTIONS["kl"])
  gap = jnp.full(args[1].shape, -jnp.inf, jnp.float32)
  ours = loss_and_grad(args, dict(kw, support_gap=gap), impl=impl, platform="cpu", interpret=True)
  plain = loss_and_grad(args, kw, impl=impl, platform="cpu", interpret=True)
  for a in jax.tree.leaves(ours):
    assert not np.isnan(np.asarray(a, np.float32)).any()
  if impl == "xla":
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  else:
    assert_loss_parity(ours, plain, args, kw, "-inf gaps")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_logit_shift_leaves_the_result(impl):
  """Catches: a gap read as an absolute threshold (a row's constant shift changes S)."""
  args, kw = gap_problem(jnp.float32, "kl")
  shift = jnp.asarray(
    np.random.default_rng(0).normal(size=args[0].shape[:2] + (1,)) * 5, jnp.float32
  )
  shifted = (args[0] + shift, *args[1:])
  a = loss_and_grad(args, kw, impl=impl, platform="cpu", interpret=True)
  b = loss_and_grad(shifted, kw, impl=impl, platform="cpu", interpret=True)
  np.testing.assert_allclose(float(a[0]), float(b[0]), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(a[2]), np.asarray(b[2]), atol=1e-5)


def test_gradient_is_zero_outside_the_support_and_y_is_inside():
  """Catches: a backward that spreads -p over the filtered columns, and y dropped from its own set
  when z_y + gap rounds above z_y (a gap of exactly 0: S = {v : z_v >= z_y})."""
  args, kw = gap_problem(jnp.float32, "on_policy")
  gap = kw["support_gap"].at[0, 0].set(0.0)
  ours = loss_and_grad(
    args, dict(kw, support_gap=gap), impl="pallas", platform="cpu", interpret=True
  )
  z = np.asarray(args[0], np.float32)
  thr = np.take_along_axis(z, np.asarray(args[1])[..., None], axis=-1) + np.asarray(gap)[..., None]
  outside = (z < thr) & ~(np.arange(z.shape[-1]) == np.asarray(args[1])[..., None])
  assert outside.any()
  assert np.all(np.asarray(ours[2])[outside] == 0)
  logp = np.asarray(ours[1].per_token_logps)
  assert np.all(np.isfinite(logp)) and np.all(logp <= 1e-6)


@pytest.mark.parametrize(
  "gap,match",
  [(0.5, "support_gap must be <= 0"), (np.nan, "support_gap")],
)
def test_bad_gaps_are_refused_naming_the_argument(gap, match):
  args, _ = make_problem(2, 3, 16, jnp.float32, seed=0, empty_row=False)
  bad = jnp.full(args[1].shape, gap, jnp.float32).at[0, 0].set(gap)
  mask = jnp.ones(args[1].shape, bool)
  with pytest.raises(ValueError, match=match):
    kernels.grpo_loss(args[0], args[1], mask, args[3], support_gap=bad, impl="xla")
  with pytest.raises(ValueError, match="support_gap"):
    kernels.grpo_loss(args[0], args[1], mask, args[3], support_gap=jnp.zeros((2, 4)), impl="xla")


def test_fused_linear_scores_over_the_support_in_every_impl():
  """Catches: the fused loss's reference dropping the gap (it must equal grpo_loss on hidden @
  head), and a fused kernel impl scoring a gapped call over the full softmax (the kernels' own
  parity with gaps: tests/kernels/fused_linear/test_support_gap.py)."""
  rng = np.random.default_rng(5)
  hidden = jnp.asarray(rng.normal(size=(2, 4, 16)) * 0.3, jnp.float32)
  head = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
  mask, adv = jnp.ones((2, 4), bool), jnp.asarray([1.0, -0.5], jnp.float32)
  logits = jnp.einsum("bth,hv->btv", hidden, head)
  # sampled-like ids: each among its row's top 3, so a top-k set cuts the tail below it
  rank = jnp.asarray(rng.integers(0, 3, size=(2, 4)))
  ids = jnp.take_along_axis(jnp.argsort(-logits, axis=-1), rank[..., None], axis=-1)[..., 0]
  gap = top_k_gaps(logits, ids, 1.0, seed=5)
  fused = kernels.fused_linear_grpo_loss(hidden, head, ids, mask, adv, support_gap=gap, impl="xla")
  plain = kernels.grpo_loss(logits, ids, mask, adv, support_gap=gap, impl="xla")
  ungapped = kernels.grpo_loss(logits, ids, mask, adv, impl="xla")
  for a, e in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=1e-5, atol=1e-5)  # fmt: skip
  # on-policy the loss value is -A whatever log p is: the log-probs show the support
  assert np.abs(plain[1].per_token_logps - ungapped[1].per_token_logps).max() > 1e-3
  for impl in ("pallas", "chunked"):
    ours = kernels.fused_linear_grpo_loss(hidden, head, ids, mask, adv, support_gap=gap, impl=impl, interpret=True)  # fmt: skip
    np.testing.assert_allclose(ours[1].per_token_logps, plain[1].per_token_logps, rtol=1e-5, atol=1e-5, err_msg=impl)  # fmt: skip
