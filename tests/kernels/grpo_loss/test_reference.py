"""The reference checked on its own: a hand-computed case and an independent float64 NumPy formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.tolerances import assert_close
from kernels.grpo_loss.reference import grpo_loss_reference, reduce_loss
from tests.problems import loss_scale


def test_hand_computed_two_token_vocab():
  # logits [0, ln 3] -> p = [1/4, 3/4]; token 1 chosen, logp = ln(3/4).
  logits = jnp.array([[[0.0, math.log(3.0)]]])
  ids = jnp.array([[1]])
  mask = jnp.array([[True]])
  # on-policy: ratio 1, loss = -A
  loss, aux = grpo_loss_reference(logits, ids, mask, jnp.array([2.0]))
  assert float(loss) == pytest.approx(-2.0)
  assert float(aux.per_token_logps[0, 0]) == pytest.approx(math.log(0.75))
  assert float(aux.entropy[0, 0]) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
  # d loss / d logits = -A * (onehot - p) = -2 * ([0, 1] - [1/4, 3/4]) = [0.5, -0.5]
  grad = jax.grad(lambda x: grpo_loss_reference(x, ids, mask, jnp.array([2.0]))[0])(logits)
  np.testing.assert_allclose(grad[0, 0], [0.5, -0.5], rtol=1e-6)
  # off-policy, ratio = 1.5 > 1 + 0.2 with A > 0: clipped, loss = -1.2 * A, zero gradient
  old = jnp.log(jnp.array([[0.75 / 1.5]]))
  loss, aux = grpo_loss_reference(logits, ids, mask, jnp.array([2.0]), old_logps=old)
  assert float(loss) == pytest.approx(-2.4, rel=1e-6)
  assert bool(aux.is_clipped[0, 0])
  grad = jax.grad(lambda x: grpo_loss_reference(x, ids, mask, jnp.array([2.0]), old_logps=old)[0])(
    logits
  )
  np.testing.assert_array_equal(grad, 0.0)
  # k3 KL with ref = logp - ln 2: exp(-ln 2) + ln 2 - 1
  ref = aux.per_token_logps - math.log(2.0)
  loss, aux = grpo_loss_reference(logits, ids, mask, jnp.array([0.0]), ref_logps=ref, beta=0.5)
  kl = 0.5 + math.log(2.0) - 1.0
  assert float(aux.per_token_kl[0, 0]) == pytest.approx(kl, rel=1e-5)
  assert float(loss) == pytest.approx(0.5 * kl, rel=1e-5)


def test_reductions_by_hand():
  per_token = jnp.array([[1.0, 2.0, 3.0], [4.0, jnp.nan, jnp.nan], [jnp.nan, jnp.nan, jnp.nan]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
  assert float(reduce_loss(per_token, mask, loss_type="grpo")) == pytest.approx(
    (2.0 + 4.0 + 0.0) / 3
  )
  assert float(reduce_loss(per_token, mask, loss_type="bnpo")) == pytest.approx(10.0 / 4)
  assert float(reduce_loss(per_token, mask, loss_type="dr_grpo")) == pytest.approx(10.0 / 9)
  assert float(
    reduce_loss(per_token, mask, loss_type="dr_grpo", max_completion_length=5)
  ) == pytest.approx(10 / 15)
  assert float(reduce_loss(per_token, mask, loss_type="dapo")) == pytest.approx(10.0 / 4)
  assert float(
    reduce_loss(per_token, mask, loss_type="dapo", num_items_in_batch=20.0)
  ) == pytest.approx(0.5)
  # all masked: zero, not NaN
  assert float(reduce_loss(per_token, jnp.zeros_like(mask), loss_type="grpo")) == 0.0


def _numpy_f64(logits, ids, mask, adv, old, ref, beta, el, eh, temp, loss_type):
  z = logits.astype(np.float64) / temp
  z = z - z.max(-1, keepdims=True)
  logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = np.take_along_axis(logsm, ids[..., None], -1)[..., 0]
  entropy = -(np.exp(logsm) * logsm).sum(-1)
  ratio = np.ones_like(logp) if old is None else np.exp(logp - old)
  a = adv[:, None]
  per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - el, 1 + eh) * a)
  kl = np.zeros_like(logp)
  if beta:
    kl = np.exp(ref - logp) - (ref - logp) - 1
    per_token += beta * kl
  m = mask.astype(np.float64)
  s = per_token * m
  loss = {
    "grpo": (s.sum(-1) / np.maximum(m.sum(-1), 1)).mean(),
    "bnpo": s.sum() / max(m.sum(), 1),
    "dr_grpo": s.sum() / m.size,
    "dapo": s.sum() / max(m.sum(), 1),
  }[loss_type]
  return loss, logp * m, entropy * m, kl * m


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(
  "off_policy,beta,temp", [(False, 0.0, 1.0), (True, 0.0, 0.7), (True, 0.04, 1.3)]
)
def test_reference_matches_float64_numpy(loss_type, off_policy, beta, temp):
  rng = np.random.default_rng(7)
  b, t, v = 4, 6, 257
  logits = rng.normal(size=(b, t, v)).astype(np.float32) * 2
  ids = rng.integers(0, v, size=(b, t))
  mask = rng.random((b, t)) < 0.7
  mask[0] = False
  adv = rng.normal(size=b).astype(np.float32)
  z = logits / temp
  true_logp = np.take_along_axis(z - np.log(np.exp(z).sum(-1, keepdims=True)), ids[..., None], -1)[
    ..., 0
  ]
  old = (true_logp + rng.normal(scale=0.3, size=(b, t))).astype(np.float32) if off_policy else None
  ref = (true_logp + rng.normal(scale=0.3, size=(b, t))).astype(np.float32) if beta else None
  loss, aux = grpo_loss_reference(
    jnp.asarray(logits),
    jnp.asarray(ids),
    jnp.asarray(mask),
    jnp.asarray(adv),
    old_logps=None if old is None else jnp.asarray(old),
    ref_logps=None if ref is None else jnp.asarray(ref),
    beta=beta,
    epsilon_low=0.15,
    epsilon_high=0.3,
    temperature=temp,
    loss_type=loss_type,
  )
  e_loss, e_logp, e_ent, e_kl = _numpy_f64(
    logits, ids, mask, adv, old, ref, beta, 0.15, 0.3, temp, loss_type
  )
  kw = dict(old_logps=old, beta=beta, epsilon_low=0.15, epsilon_high=0.3)
  assert_close(
    loss, e_loss, "f64_check", np.float32, v, scale=max(loss_scale(aux, mask, adv, kw), abs(e_loss))
  )
  assert_close(aux.per_token_logps, e_logp, "f64_check", np.float32, v)
  assert_close(aux.entropy, e_ent, "f64_check", np.float32, v)
  assert_close(aux.per_token_kl, e_kl, "f64_check", np.float32, v)


def test_log_ratio_clamp_by_hand():
  """old = logp - 100: the log-ratio clamps to 20, ratio = e^20, zero gradient beyond the bound."""
  logits = jnp.array([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
  ids, mask = jnp.array([[1, 1]]), jnp.array([[True, True]])
  logp = math.log(0.75)
  old = jnp.full((1, 2), logp - 100.0)
  ref = jnp.full((1, 2), logp + 100.0)
  e20 = math.exp(20.0)

  def loss(x, adv, **kw):
    return grpo_loss_reference(x, ids, mask, jnp.array([adv]), old_logps=old, **kw)[0]

  # A > 0: ratio e^20 > 1 + eps_high, clipped: loss = -(1 + 0.2) A. A < 0: -min(e^20 A, 1.2 A) = -e^20 A.
  assert float(loss(logits, 2.0)) == pytest.approx(-2.4, rel=1e-6)
  assert float(loss(logits, -2.0)) == pytest.approx(2.0 * e20, rel=1e-6)
  # Unclamped, the same input overflows: exp(100) is inf in f32.
  assert not np.isfinite(float(loss(logits, -2.0, max_log_ratio=None)))
  np.testing.assert_array_equal(jax.grad(loss)(logits, -2.0), 0.0)  # beyond the bound: no gradient
  # A looser bound is honoured: max_log_ratio = 50 -> ratio e^50 (finite in f32: 5.2e21).
  assert float(loss(logits, -1.0, max_log_ratio=50.0)) == pytest.approx(math.exp(50.0), rel=1e-5)
  # k3 KL with ref = logp + 100 clamps to d = 20: e^20 - 20 - 1, and no gradient through it.
  _, aux = grpo_loss_reference(
    logits, ids, mask, jnp.array([0.0]), ref_logps=ref, beta=0.5, epsilon_low=0.1
  )
  np.testing.assert_allclose(aux.per_token_kl, e20 - 21.0, rtol=1e-6)
  kl_grad = jax.grad(
    lambda x: grpo_loss_reference(x, ids, mask, jnp.array([0.0]), ref_logps=ref, beta=0.5)[0]
  )(logits)
  np.testing.assert_array_equal(kl_grad, 0.0)
  # Inside the bound the gradient is the unclamped one: log ratio 19 < 20.
  near = jnp.full((1, 2), logp - 19.0)
  g = jax.grad(lambda x: grpo_loss_reference(x, ids, mask, jnp.array([-1.0]), old_logps=near)[0])(
    logits
  )
  # d/dlogits of -ratio * A / 2 per token (grpo mean over 2 tokens): e^19 / 2 * (onehot - p) each
  np.testing.assert_allclose(
    g[0, 0], [-0.25 * math.exp(19.0) / 2, 0.25 * math.exp(19.0) / 2], rtol=1e-5
  )


def test_entropy_of_a_top_k_masked_row_by_hand():
  """Logits [0, ln 3, -inf, -inf]: p = [1/4, 3/4, 0, 0]; 0 * log 0 = 0, so H = the 2-token entropy."""
  logits = jnp.array([[[0.0, math.log(3.0), -jnp.inf, -jnp.inf]]])
  loss, aux = grpo_loss_reference(logits, jnp.array([[1]]), jnp.array([[True]]), jnp.array([1.0]))
  assert float(aux.entropy[0, 0]) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
  assert float(loss) == pytest.approx(-1.0)


def test_dapo_divides_by_num_items_in_batch():
  per_token = jnp.array([[1.0, 2.0], [3.0, 4.0]])
  mask = jnp.array([[True, False], [True, True]])
  out = reduce_loss(per_token, mask, loss_type="dapo", num_items_in_batch=jnp.float32(16.0))
  assert float(out) == pytest.approx(8.0 / 16.0)
  # a traced count <= 0 cannot be rejected: NaN, never +-inf
  assert np.isnan(reduce_loss(per_token, mask, loss_type="dapo", num_items_in_batch=0.0))


def test_kl_estimators_by_hand():
  """k1 / k2 / k3 on the two-token vocabulary (logp = ln 3/4) with ref = logp - ln 2 (d = -ln 2):
  k3 = e^d - d - 1, k1 = -d, k2 = d^2 / 2, and their gradients d kl / d logp = 1 - e^d, 1, -d, times
  (onehot - p) for the logits. Catches: estimators swapped or their sign flipped (k1's "logp - ref")."""
  logits = jnp.array([[[0.0, math.log(3.0)]]])
  ids, mask = jnp.array([[1]]), jnp.array([[True]])
  ref = jnp.array([[math.log(0.75) - math.log(2.0)]])
  d = -math.log(2.0)
  expected = {"k3": (math.exp(d) - d - 1, 1 - math.exp(d)), "k1": (-d, 1.0), "k2": (d * d / 2, -d)}
  onehot_minus_p = np.array([-0.25, 0.25])
  for estimator, (kl, dkl) in expected.items():

    def f(x, estimator=estimator):
      return grpo_loss_reference(
        x, ids, mask, jnp.array([0.0]), ref_logps=ref, beta=0.5, kl_estimator=estimator
      )

    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(logits)
    assert float(aux.per_token_kl[0, 0]) == pytest.approx(kl, rel=1e-5), estimator
    assert float(loss) == pytest.approx(0.5 * kl, rel=1e-5), estimator
    np.testing.assert_allclose(grad[0, 0], 0.5 * dkl * onehot_minus_p, rtol=1e-5, err_msg=estimator)


def test_kl_estimators_clamped():
  """d = ref - logp beyond +-max_log_ratio is clamped in every estimator, with zero gradient:
  a -inf ref (a sampler's masked token) gives a finite k1 / k2 like k3."""
  logits = jnp.array([[[0.0, math.log(3.0)]]])
  ids, mask = jnp.array([[1]]), jnp.array([[True]])
  for estimator, kl in (("k1", 20.0), ("k2", 200.0), ("k3", math.exp(-20) + 19)):

    def f(x, estimator=estimator):
      out = grpo_loss_reference(
        x, ids, mask, jnp.array([0.0]), ref_logps=jnp.array([[-jnp.inf]]), beta=1.0,
        kl_estimator=estimator,
      )  # fmt: skip
      return out[0]

    assert float(f(logits)) == pytest.approx(kl, rel=1e-5), estimator
    np.testing.assert_array_equal(jax.grad(f)(logits), 0.0)


def test_gspo_token_by_hand():
  """GSPO-token on one sequence of two tokens with logp - old = (0.1, 0.5): the ratio is
  exp(mean) = e^0.3 for both tokens (below 1 + epsilon_high: unclipped). With A = -1 the loss
  (grpo's mean) is e^0.3 and each token's gradient its own, d loss / d logp_t = e^0.3 / 2. With
  per-token A = (-1, -2) GSPO-token gives (0.5, 1.0) e^0.3 where GSPO's differentiable sequence
  ratio spreads the sum, 0.75 e^0.3 each (catches GSPO-token computed as GSPO). The cap: a mean of
  0.3 capped at 0.2 gives e^0.2 and no gradient."""
  logits = jnp.array([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
  ids, mask = jnp.array([[1, 1]]), jnp.array([[True, True]])
  lp = math.log(0.75)
  old = jnp.array([[lp - 0.1, lp - 0.5]])
  onehot_minus_p = np.array([-0.25, 0.25])
  e = math.exp(0.3)

  def f(x, adv=(-1.0,), level="sequence_token", **o):
    adv = jnp.array([adv]) if len(adv) == 2 else jnp.array(adv)
    kw = dict(old_logps=old, importance_sampling_level=level, epsilon_high=0.5)
    return grpo_loss_reference(x, ids, mask, adv, **kw, **o)[0]

  assert float(f(logits)) == pytest.approx(e, rel=1e-6)
  np.testing.assert_allclose(jax.grad(f)(logits)[0], [e / 2 * onehot_minus_p] * 2, rtol=1e-6)
  per_token = lambda level: jax.grad(lambda x: f(x, adv=(-1.0, -2.0), level=level))(logits)[0]
  np.testing.assert_allclose(per_token("sequence_token"), [0.5 * e * onehot_minus_p, 1.0 * e * onehot_minus_p], rtol=1e-6)  # fmt: skip
  np.testing.assert_allclose(per_token("sequence"), [0.75 * e * onehot_minus_p] * 2, rtol=1e-6)
  assert float(f(logits, sequence_log_ratio_cap=0.2)) == pytest.approx(math.exp(0.2), rel=1e-6)
  np.testing.assert_array_equal(jax.grad(lambda x: f(x, sequence_log_ratio_cap=0.2))(logits), 0.0)


def test_new_spec_fields_validated():
  from kernels import LossSpec

  with pytest.raises(ValueError, match="kl_estimator must be one of"):
    LossSpec(kl_estimator="k4")
  with pytest.raises(ValueError, match="sequence_log_ratio_cap needs importance_sampling_level"):
    LossSpec(sequence_log_ratio_cap=10.0)
  with pytest.raises(ValueError, match="sequence_log_ratio_cap"):
    LossSpec(importance_sampling_level="sequence_token", sequence_log_ratio_cap=0.0)
  assert LossSpec(importance_sampling_level="sequence_token").sequence_level
  assert hash(LossSpec(kl_estimator="k1")) == hash(LossSpec(kl_estimator="k1"))
