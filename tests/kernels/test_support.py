"""The sampled-support rule (kernels.support) on tiny hand-computed rows, through the reference's
plain log-prob entry point (``token_logps_and_entropy``) and its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import support
from kernels.grpo_loss import token_logps_and_entropy

ROW = jnp.array([[3.0, 2.0, 1.0, 0.0]])  # [1, V=4]; id 1 with gap -1 keeps {0, 1, 2}


def _logp(logits, ids, gap, temperature=1.0):
  logp, entropy = token_logps_and_entropy(logits, jnp.array(ids), temperature, jnp.array(gap))
  return float(logp[0]), float(entropy[0])


def test_hand_computed_row_and_its_gradient():
  """The set {z >= z_y + g} by hand: catches a strict > at the boundary, y's own row excluded, or a
  gradient that leaks into the filtered column (it must be 1[v = y] - p~_v on S, 0 outside)."""
  logp, entropy = _logp(ROW, [1], [-1.0])
  kept = np.array([3.0, 2.0, 1.0])
  lse = np.log(np.exp(kept).sum())
  p = np.exp(kept - lse)
  assert logp == pytest.approx(2.0 - lse, rel=1e-6)
  assert entropy == pytest.approx(-(p * np.log(p)).sum(), rel=1e-6)
  grad = jax.grad(
    lambda x: token_logps_and_entropy(x, jnp.array([1]), 1.0, jnp.array([-1.0]))[0][0]
  )
  np.testing.assert_allclose(grad(ROW)[0], [-p[0], 1 - p[1], -p[2], 0.0], rtol=1e-6, atol=1e-7)


def test_gap_is_taken_after_the_temperature():
  """g is in units of z = logits / T: catches a gap applied to the raw logits (here that keeps {0, 1}
  instead of {0, 1, 2})."""
  assert _logp(ROW * 2.0, [1], [-1.0], temperature=2.0) == pytest.approx(_logp(ROW, [1], [-1.0]))


def test_ties_at_the_boundary_are_kept_and_a_shift_changes_nothing():
  """Tokens tied with the threshold are in S (the sampler's threshold rule), and a constant shift of
  the row leaves S and log p~ unchanged (the gap is relative to z_y)."""
  tied = jnp.array([[3.0, 2.0, 1.0, 1.0]])
  logp, _ = _logp(tied, [1], [-1.0])
  assert logp == pytest.approx(2.0 - np.log(np.exp([3.0, 2.0, 1.0, 1.0]).sum()), rel=1e-6)
  assert _logp(tied + 1000.0, [1], [-1.0])[0] == pytest.approx(logp, abs=1e-4)


def test_y_stays_in_its_own_set_and_minus_inf_gaps_are_the_full_softmax():
  """A gap of 0 (y is the smallest kept token) keeps y: catches a strict comparison that drops y
  from its own set (log p~ = -inf). A -inf gap is exactly the unfiltered log-softmax, with no NaN
  from -inf + -inf or from -inf logits, in the value or the gradient."""
  logp, _ = _logp(ROW, [2], [0.0])
  assert logp == pytest.approx(1.0 - np.log(np.exp([3.0, 2.0, 1.0]).sum()), rel=1e-6)
  full, ent_full = token_logps_and_entropy(ROW, jnp.array([2]), 1.0)
  gapped, ent_gap = token_logps_and_entropy(ROW, jnp.array([2]), 1.0, jnp.array([-jnp.inf]))
  assert float(gapped[0]) == float(full[0]) and float(ent_gap[0]) == float(ent_full[0])
  masked_row = jnp.array([[-jnp.inf, 0.0, -jnp.inf, -jnp.inf]])
  grad = jax.grad(
    lambda x: token_logps_and_entropy(x, jnp.array([1]), 1.0, jnp.array([-jnp.inf]))[0][0]
  )
  assert np.isfinite(np.asarray(grad(masked_row))).all()


def test_threshold_carries_no_gradient_and_gapped_keeps_hits():
  """A kernel whose z_y (for the threshold) comes from another computation than its tile's z (the
  fused head's gathered column vs the MXU tile) may round z_y + g above the tile's z_y: the hit term
  keeps y regardless. Catches a kernel that forgets to pass its hit mask."""
  z = jnp.array([[0.0, 5.0]])
  out = support.gapped(z, jnp.array([[1.0]]), jnp.array([[True, False]]))
  np.testing.assert_array_equal(out, [[0.0, 5.0]])
  assert jax.grad(lambda a: support.threshold(a, jnp.float32(-1.0)))(2.0) == 0.0
