"""The LossSpec options (importance correction, GSPO, dual clip, per-token advantages): the reference
against hand-computed and float64 values, and both kernel families (and the Mosaic GPU kernel) against
the reference on seeded and hypothesis problems."""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import kernels
from bench.tolerances import assert_close
from kernels import LossSpec
from kernels.grpo_loss.reference import LOSS_TYPES, grpo_loss_reference, reduce_loss
from kernels.objective import policy_objective
from tests.kernels.grpo_loss.test_grpo_loss import (
  FAMILIES,
  IMPL_CALLS,
  loss_and_grad,
  make_problem,
  pallas_kw,
)
from tests.problems import assert_loss_parity


# -------------------------------------------------------------------------- float64 hand formula
def objective_f64(logp, mask, adv, *, old=None, ref=None, sampler=None, **options):
  """The issue's formulas in float64 NumPy, written independently of kernels.objective. Returns
  (loss, per_token, is_weight, sampler_log_ratio, capped_by_dual_clip)."""
  spec = LossSpec(**options)
  m = np.asarray(mask, np.float64)
  logp = np.where(m > 0, np.asarray(logp, np.float64), 0.0)
  a = np.asarray(adv, np.float64)
  a = a[:, None] * np.ones_like(logp) if a.ndim == 1 else a
  o = logp if old is None else np.asarray(old, np.float64)
  r = logp - o
  if spec.importance_sampling_level == "sequence":
    r = ((r * m).sum(-1, keepdims=True) / np.maximum(m.sum(-1, keepdims=True), 1)) + 0 * r
  bound = spec.max_log_ratio
  ratio = np.exp(r if bound is None else np.clip(r, -bound, bound))
  lo, hi = 1 - spec.epsilon_low, 1 + spec.epsilon_high
  surr = np.minimum(ratio * a, np.clip(ratio, lo, hi) * a)
  capped = np.zeros(surr.shape, bool)
  if spec.epsilon_c is not None:
    capped = (a < 0) & (spec.epsilon_c * a > surr)
    surr = np.where(a < 0, np.maximum(surr, spec.epsilon_c * a), surr)
  slr = np.zeros_like(logp) if sampler is None else (o - np.asarray(sampler, np.float64)) * m
  w = np.ones_like(logp)
  if spec.is_mode is not None:
    x = slr
    if spec.is_mode.startswith("sequence"):
      x = slr.sum(-1, keepdims=True) + 0 * slr
    with np.errstate(over="ignore"):
      rho = np.exp(x)
    w = (
      np.minimum(rho, spec.is_cap)
      if spec.is_mode.endswith("truncate")
      else np.where(rho <= spec.is_cap, rho, 0.0)
    )
  per_token = -surr * w
  if spec.beta:
    d = np.asarray(ref, np.float64) - logp
    d = d if bound is None else np.clip(d, -bound, bound)
    per_token = per_token + spec.beta * (np.exp(d) - d - 1)
  s = per_token * m
  b, t = logp.shape
  loss = {
    "grpo": (s.sum(-1) / np.maximum(m.sum(-1), 1)).mean(),
    "bnpo": s.sum() / max(m.sum(), 1),
    "dr_grpo": s.sum() / (b * (spec.max_completion_length or t)),
    "dapo": s.sum() / max(m.sum(), 1),
  }[spec.loss_type]
  return loss, per_token * m, w * m, slr, capped & (m > 0)


def _logp_f64(logits, ids, temperature):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return np.take_along_axis(logsm, np.asarray(ids)[..., None], -1)[..., 0], np.exp(logsm)


# Each mode with data where it is active (checked below, so a no-op mode cannot pass).
MODES = {
  "token_truncate": dict(is_mode="token_truncate", is_cap=1.2),
  "token_mask": dict(is_mode="token_mask", is_cap=1.2),
  "sequence_truncate": dict(is_mode="sequence_truncate", is_cap=1.2),
  "sequence_mask": dict(is_mode="sequence_mask", is_cap=1.2),
  "gspo": dict(importance_sampling_level="sequence"),
  "gspo_on_policy": dict(importance_sampling_level="sequence", on_policy=True),
  "dual_clip": dict(epsilon_c=1.1),
  "all": dict(
    importance_sampling_level="sequence", is_mode="sequence_truncate", is_cap=1.2, epsilon_c=1.05
  ),
}


def _random_problem(seed, mode, b=5, t=7, v=257, temperature=0.9):
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(b, t, v)) * 2).astype(np.float32)
  ids = rng.integers(0, v, size=(b, t))
  lengths = rng.integers(1, t + 1, size=b)
  lengths[0] = 0  # an all-masked sequence
  lengths[1] = t  # a full one (A < 0 below: the dual clip needs such tokens)
  mask = np.arange(t)[None, :] < lengths[:, None]  # ragged lengths
  adv = rng.normal(size=b).astype(np.float32)
  adv[1], adv[2] = -abs(adv[1]) - 0.5, abs(adv[2]) + 0.5  # both signs, for the dual clip
  logp, _ = _logp_f64(logits, ids, temperature)
  options = dict(MODES[mode])
  on_policy = options.pop("on_policy", False)
  old = None if on_policy else (logp + rng.normal(scale=0.3, size=(b, t))).astype(np.float32)
  base = logp if old is None else old
  sampler = (base + rng.normal(scale=0.3, size=(b, t))).astype(np.float32)
  ref = (logp + rng.normal(scale=0.3, size=(b, t))).astype(np.float32)
  options.update(beta=0.04, temperature=temperature, epsilon_low=0.15, epsilon_high=0.25)
  return (logits, ids, mask, adv), dict(old=old, ref=ref, sampler=sampler), options


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("mode", MODES)
def test_reference_matches_float64_formula(mode, loss_type):
  """Loss, aux and dlogits of the f32 reference against the float64 formula; the dlogits expected
  value is d loss / d logp by central differences of the f64 formula, times (onehot - p) / T."""
  (logits, ids, mask, adv), logps, options = _random_problem(3, mode)
  options["loss_type"] = loss_type
  arr = lambda x: None if x is None else jnp.asarray(x)
  kw = dict(
    old_logps=arr(logps["old"]), ref_logps=arr(logps["ref"]), sampler_logps=arr(logps["sampler"])
  )

  def f(x):
    return grpo_loss_reference(
      x, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(adv), **kw, **options
    )

  (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logits))
  temp = options["temperature"]
  logp, p = _logp_f64(logits, ids, temp)
  e_loss, e_pt, e_w, e_slr, e_capped = objective_f64(logp, mask, adv, **logps, **options)
  v = logits.shape[-1]
  scale = max(float(np.max(np.abs(e_pt))), abs(e_loss))
  assert_close(loss, e_loss, "f64_check", np.float32, v, mode, scale=scale)
  assert_close(aux.is_weight, e_w, "f64_check", np.float32, v, f"{mode} is_weight")
  assert_close(aux.sampler_log_ratio, e_slr, "f64_check", np.float32, v, f"{mode} slr")
  # the mode is really exercised by this data
  w = e_w[mask]
  if "truncate" in options.get("is_mode", ""):
    assert (w == options["is_cap"]).any() and (w < options["is_cap"]).any()
  if "mask" in (options.get("is_mode") or "").split("_")[-1:]:
    assert (w == 0).any() and (w > 0).any()
  if "epsilon_c" in options:
    assert e_capped.any()
    np.testing.assert_array_equal(np.asarray(aux.is_clipped)[e_capped], True)
  # d loss / d logp by central differences in float64, token by token
  old = logps["old"]
  dlogp = np.zeros_like(logp)
  for idx in zip(*np.nonzero(mask)):
    h = 1e-6
    for sgn in (1, -1):
      lp = logp.copy()
      lp[idx] += sgn * h
      # on-policy, old = stop_gradient(logp): it stays at the unperturbed value
      o = logp if old is None else old
      dlogp[idx] += sgn * objective_f64(lp, mask, adv, **dict(logps, old=o), **options)[0] / (2 * h)
  onehot = np.eye(v)[ids]
  e_grad = dlogp[..., None] * (onehot - p) / temp
  assert_close(grad, e_grad, "f64_check", np.float32, v, f"{mode} dlogits")
  np.testing.assert_array_equal(np.asarray(grad)[0], 0.0)  # the all-masked sequence


# ------------------------------------------------------------------------------- hand-computed
# logits [0, ln 3]: p = [1/4, 3/4]; every token picks id 1, so logp = ln(3/4) and
# d logp / d logits = onehot - p = [-1/4, 1/4].
LN34 = math.log(0.75)


def _two_token_problem(b, t):
  logits = jnp.tile(jnp.array([0.0, math.log(3.0)]), (b, t, 1))
  return logits, jnp.ones((b, t), jnp.int32)


def test_gspo_ragged_lengths_and_all_masked_sequence_by_hand():
  """Row 0: 2 tokens, row 1: 4 tokens, row 2: all masked (NaN old / sampler there). GSPO: every token
  of a row has ratio exp(L_b), L_b the masked mean of logp - old; with sequence_mask and no clipping
  the row's loss is -w_b A_b exp(L_b), and d loss / d logp_t = -w_b A_b exp(L_b) / (n_b B)."""
  logits, ids = _two_token_problem(3, 4)
  mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  gaps = np.array([[0.05, 0.15, 9.0, 9.0], [0.1, -0.1, 0.2, 0.0], [np.nan] * 4])  # logp - old
  old = jnp.asarray(LN34 - gaps, jnp.float32)
  slr = np.array([[0.25, -0.5, 7.0, 7.0], [0.1, 0.1, 0.1, 0.1], [np.nan] * 4])  # old - s
  sampler = old - jnp.asarray(slr, jnp.float32)
  adv = jnp.array([1.0, -2.0, 5.0])
  kw = dict(old_logps=old, sampler_logps=sampler, importance_sampling_level="sequence")
  kw.update(is_mode="sequence_mask", is_cap=1.5, epsilon_low=0.2, epsilon_high=0.2)

  def f(x):
    return grpo_loss_reference(x, ids, mask, adv, **kw)

  (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(logits)
  big_l = np.array([0.1, 0.05])  # masked means of the gaps
  w = np.exp([-0.25, 0.4])  # exp(sum of old - s): both <= 1.5, kept
  rows = -w * np.array([1.0, -2.0]) * np.exp(big_l)
  assert float(loss) == pytest.approx(rows.sum() / 3, rel=1e-6)
  expected_w = np.array([[w[0]] * 2 + [0] * 2, [w[1]] * 4, [0] * 4])
  np.testing.assert_allclose(aux.is_weight, expected_w, rtol=1e-5)
  expected_slr = np.where(mask, np.nan_to_num(slr), 0)
  np.testing.assert_allclose(aux.sampler_log_ratio, expected_slr, rtol=1e-5, atol=1e-6)
  dlogp = np.zeros((3, 4))
  dlogp[0, :2] = rows[0] / (2 * 3)
  dlogp[1, :] = rows[1] / (4 * 3)
  expected = dlogp[..., None] * np.array([-0.25, 0.25])
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
  assert np.isfinite(np.asarray(grad)).all() and float(jnp.abs(grad[2]).max()) == 0.0


@pytest.mark.parametrize(
  "mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]
)
def test_rho_exactly_at_the_cap_is_kept(mode):
  """is_cap = 1: a sequence whose old - s sum to exactly 0 (0.5 - 0.5, exact in f32) has rho = 1 = cap:
  kept with weight 1 by both modes; a sum of 0.25 (rho > cap) is masked (0) or truncated (1)."""
  logits, ids = _two_token_problem(2, 2)
  mask = jnp.ones((2, 2), bool)
  old = jnp.array([[-1.25, -2.0], [-1.25, -2.0]])
  sampler = jnp.array([[-1.75, -1.5], [-1.5, -2.0]])  # old - s = [0.5, -0.5] and [0.25, 0]
  _, aux = grpo_loss_reference(
    logits,
    ids,
    mask,
    jnp.array([1.0, 1.0]),
    old_logps=old,
    sampler_logps=sampler,
    is_mode=mode,
    is_cap=1.0,
  )
  w = np.asarray(aux.is_weight)
  if mode.startswith("sequence"):
    np.testing.assert_array_equal(w[0], [1.0, 1.0])
    np.testing.assert_array_equal(w[1], [0.0, 0.0] if mode.endswith("mask") else [1.0, 1.0])
  else:  # token rho: [e^0.5, e^-0.5] and [e^0.25, 1]; the last is exactly the cap
    over = 0.0 if mode.endswith("mask") else 1.0
    np.testing.assert_allclose(w[0], [over, np.exp(-0.5)], rtol=1e-6)
    np.testing.assert_array_equal(w[1], [over, 1.0])


def test_token_vs_sequence_weights_by_hand():
  """old - s = [ln 3, -ln 2]: token rho = [3, 1/2], sequence rho = 3/2 for both tokens."""
  logits, ids = _two_token_problem(1, 2)
  mask, adv = jnp.ones((1, 2), bool), jnp.array([1.0])
  old = jnp.full((1, 2), LN34)
  sampler = old - jnp.array([[math.log(3.0), -math.log(2.0)]])
  expect = {
    ("token_truncate", 2.0): [2.0, 0.5],
    ("token_mask", 2.0): [0.0, 0.5],
    ("sequence_truncate", 2.0): [1.5, 1.5],
    ("sequence_mask", 2.0): [1.5, 1.5],
    ("sequence_truncate", 1.4): [1.4, 1.4],
    ("sequence_mask", 1.4): [0.0, 0.0],
  }
  for (mode, cap), w in expect.items():
    loss, aux = grpo_loss_reference(
      logits, ids, mask, adv, old_logps=old, sampler_logps=sampler, is_mode=mode, is_cap=cap
    )
    np.testing.assert_allclose(aux.is_weight[0], w, rtol=1e-6, err_msg=mode)
    # ratio 1 (old = logp): per-token loss -w * A, grpo mean over the 2 tokens
    assert float(loss) == pytest.approx(-sum(w) / 2, rel=1e-6, abs=1e-7), mode


def test_dual_clip_by_hand():
  """ratio 5 (old = logp - ln 5), c = 3: at A = -1 the PPO loss 5 is capped at c|A| = 3 with no
  gradient; at A = +1 it is the clipped -1.2 either way; at ratio 2 < c and A = -1 it is unchanged."""
  logits, ids = _two_token_problem(1, 1)
  mask = jnp.ones((1, 1), bool)

  def run(ratio, a, **kw):
    old = jnp.full((1, 1), LN34 - math.log(ratio))
    f = lambda x: grpo_loss_reference(x, ids, mask, jnp.array([a]), old_logps=old, **kw)
    (loss, aux), g = jax.value_and_grad(f, has_aux=True)(logits)
    return float(loss), bool(aux.is_clipped[0, 0]), np.asarray(g)

  loss, clipped, g = run(5.0, -1.0, epsilon_c=3.0)
  assert loss == pytest.approx(3.0) and clipped
  np.testing.assert_array_equal(g, 0.0)
  assert run(5.0, -1.0)[0] == pytest.approx(5.0, rel=1e-6)  # without the dual clip
  for kw in ({}, dict(epsilon_c=3.0)):
    loss, clipped, g = run(5.0, 1.0, **kw)
    assert loss == pytest.approx(-1.2, rel=1e-6) and clipped
    np.testing.assert_array_equal(g, 0.0)
  loss, clipped, g = run(2.0, -1.0, epsilon_c=3.0)
  assert loss == pytest.approx(2.0, rel=1e-6) and not clipped
  # d(-ratio * A) / d logits = ratio * (onehot - p) = 2 * [-1/4, 1/4]
  np.testing.assert_allclose(g[0, 0], [-0.5, 0.5], rtol=1e-5)


def test_gspo_gradient_matches_finite_differences_in_float64():
  """policy_objective in float64 (x64 on): jax.grad w.r.t. logp against central differences, GSPO with
  ragged lengths, sequence truncation and the dual clip together."""
  rng = np.random.default_rng(4)
  b, t = 4, 6
  mask = np.arange(t)[None, :] < np.array([[6], [3], [1], [0]])
  with jax.enable_x64(True):
    logp = jnp.asarray(-rng.random((b, t)) * 3, jnp.float64)
    old = logp + jnp.asarray(rng.normal(scale=0.3, size=(b, t)))
    sampler = old + jnp.asarray(rng.normal(scale=0.3, size=(b, t)))
    adv = jnp.asarray(np.broadcast_to(rng.normal(size=(b, 1)), (b, t)))
    spec = LossSpec(
      importance_sampling_level="sequence", is_mode="sequence_truncate", epsilon_c=1.05, is_cap=1.2
    )
    m = jnp.asarray(mask)

    def loss(lp):
      pt = policy_objective(lp, m, adv, spec, old_logps=old, sampler_logps=sampler).per_token
      return reduce_loss(pt, m, loss_type="grpo")

    grad = np.asarray(jax.grad(loss)(logp))
    assert grad.dtype == np.float64
    fd = np.zeros((b, t))
    for idx in np.ndindex(b, t):
      e = np.zeros((b, t))
      e[idx] = 1e-6
      fd[idx] = (float(loss(logp + e)) - float(loss(logp - e))) / 2e-6
  np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
  assert np.abs(grad[mask]).max() > 0.01  # the gradient through the sequence ratio is there
  np.testing.assert_array_equal(grad[~mask], 0.0)


# ------------------------------------------------------------------------------- kernel parity
# Every new option, each with data that activates it; unequal epsilons throughout.
NEW_OPTIONS = {
  "tis_token": dict(off_policy=True, is_mode="token_truncate", is_cap=1.2, epsilon_high=0.3),
  "mis_sequence_gspo": dict(
    off_policy=True,
    is_mode="sequence_mask",
    is_cap=1.5,
    importance_sampling_level="sequence",
    temperature=0.8,
    epsilon_low=0.15,
  ),
  "gspo_on_policy_kl": dict(
    importance_sampling_level="sequence", beta=0.04, is_mode="token_mask", is_cap=1.3
  ),
  "dual_clip_seq_trunc": dict(
    off_policy=True, epsilon_c=1.1, is_mode="sequence_truncate", is_cap=1.5, beta=0.04
  ),
}


def options_problem(b, t, v, dtype, option, seed=0, **extra):
  args, kw = make_problem(b, t, v, dtype, seed=seed, **NEW_OPTIONS[option], **extra)
  rng = np.random.default_rng(seed + 1)
  base = kw.get("old_logps")
  if base is None:
    base = grpo_loss_reference(*args, temperature=kw.get("temperature", 1.0))[1].per_token_logps
  kw["sampler_logps"] = jnp.asarray(base + rng.normal(scale=0.3, size=(b, t)), jnp.float32)
  return args, kw


def assert_options_parity(args, kw, call, loss_types, msg):
  for loss_type in loss_types:
    ours = loss_and_grad(args, kw, loss_type=loss_type, **call)
    ref = loss_and_grad(args, kw, loss_type=loss_type, impl="xla")
    assert_loss_parity(ours, ref, args, kw, f"{msg} {loss_type}")
  return ref


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", NEW_OPTIONS)
def test_parity_new_options(family, dtype, option):
  args, kw = options_problem(4, 6, 300, dtype, option, seed=21)
  call = pallas_kw(family, FAMILIES[family][1](8, 128))
  ref = assert_options_parity(args, kw, call, LOSS_TYPES, f"{family} {option}")
  w = np.asarray(ref[1].is_weight)[np.asarray(args[2])]
  assert (w != 1.0).any(), "the importance weights must be active in this data"


@given(
  b=st.integers(1, 4),
  t=st.integers(1, 9),
  v=st.integers(1, 500),
  bn=st.integers(1, 16),
  bv=st.integers(1, 300),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  family=st.sampled_from(sorted(FAMILIES)),
  option=st.sampled_from(sorted(NEW_OPTIONS)),
  loss_type=st.sampled_from(LOSS_TYPES),
  seed=st.integers(0, 2**31 - 1),
)
def test_parity_new_options_ragged_shapes(b, t, v, bn, bv, dtype, family, option, loss_type, seed):
  args, kw = options_problem(b, t, v, dtype, option, seed=seed)
  call = pallas_kw(family, FAMILIES[family][1](bn, bv))
  assert_options_parity(args, kw, call, (loss_type,), f"{family} {option}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("field", ["per_token_logps", "per_token_kl"])
def test_gradient_through_aux_with_new_options(family, field):
  args, kw = options_problem(3, 5, 300, jnp.float32, "dual_clip_seq_trunc", seed=5)
  weights = jnp.asarray(np.random.default_rng(6).normal(size=args[1].shape), jnp.float32)

  def grad(**call_kw):
    def f(x):
      loss, aux = kernels.grpo_loss(x, *args[1:], **kw, **call_kw)
      return loss + jnp.sum(weights * getattr(aux, field))

    return jax.grad(f)(args[0])

  ours, ref = grad(**pallas_kw(family, FAMILIES[family][1](8, 128))), grad(impl="xla")
  assert float(jnp.max(jnp.abs(ref))) > 0.1
  assert_close(ours, ref, "grad", jnp.float32, 300, f"d (loss + {field}) / dlogits")


# ---------------------------------------------------------------------- per-token advantages
@pytest.mark.parametrize("impl", IMPL_CALLS)
def test_per_token_advantages_equal_broadcast_sequence_advantages(impl):
  """[B, T] advantages that repeat each sequence's value give bit for bit the [B] result."""
  args, kw = options_problem(3, 5, 200, jnp.float32, "mis_sequence_gspo", seed=8)
  per_seq = loss_and_grad(args, kw, **IMPL_CALLS[impl])
  tiled = (*args[:3], jnp.broadcast_to(args[3][:, None], args[1].shape))
  per_tok = loss_and_grad(tiled, kw, **IMPL_CALLS[impl])
  for a, e in zip(jax.tree.leaves(per_tok), jax.tree.leaves(per_seq)):
    np.testing.assert_array_equal(a, e, err_msg=impl)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("option", ["tis_token", "dual_clip_seq_trunc"])
def test_per_token_advantages_parity(family, option):
  """Genuinely per-token advantages (NaN at masked positions, which must be ignored)."""
  args, kw = options_problem(4, 6, 300, jnp.float32, option, seed=9)
  rng = np.random.default_rng(10)
  adv = jnp.asarray(rng.normal(size=args[1].shape), jnp.float32)
  adv = jnp.where(args[2], adv, jnp.nan)
  args = (*args[:3], adv)
  call = pallas_kw(family, FAMILIES[family][1](8, 128))
  ours = loss_and_grad(args, kw, **call)
  ref = loss_and_grad(args, kw, impl="xla")
  assert np.isfinite(float(ref[0]))
  # per-token advantages change the loss: against each row's first advantage broadcast
  first = jnp.broadcast_to(jnp.nan_to_num(adv)[:, :1], adv.shape)
  assert float(loss_and_grad((*args[:3], first), kw, impl="xla")[0]) != float(ref[0])
  scale_args = (*args[:3], jnp.max(jnp.abs(jnp.nan_to_num(adv)), axis=1))  # loss_scale takes [B]
  assert_loss_parity(ours, ref, scale_args, kw, f"{family} {option} per-token A")


# ------------------------------------------------------------------------- extreme inputs
@pytest.mark.parametrize(
  "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
@pytest.mark.parametrize("gap", [100.0, -100.0])
def test_stale_sampler_finite_loss_and_grads_in_every_impl(mode, gap):
  """old - s = +-100 (a stale or broken engine): rho = e^100 overflows f32 to inf, and e^-100 to 0;
  truncation gives the cap, masking 0: finite loss, aux and gradients, all impls agree."""
  args, kw = make_problem(3, 5, 300, jnp.float32, off_policy=True, seed=12, beta=0.04)
  kw = dict(kw, sampler_logps=kw["old_logps"] - gap, is_mode=mode, is_cap=2.0)
  kw["importance_sampling_level"] = "sequence"
  results = {name: loss_and_grad(args, kw, **call) for name, call in IMPL_CALLS.items()}
  mask = np.asarray(args[2])
  for name, (loss, aux, grad) in results.items():
    for what, x in [("loss", loss), ("grad", grad), *zip(aux._fields, aux)]:
      assert np.isfinite(np.asarray(x, np.float32)).all(), f"{name} {what}"
    w = np.asarray(aux.is_weight)[mask]
    expected = 2.0 if (gap > 0 and mode.endswith("truncate")) else 0.0
    np.testing.assert_array_equal(w, expected, err_msg=name)
    np.testing.assert_allclose(np.asarray(aux.sampler_log_ratio)[mask], gap, rtol=1e-6)
    v = args[0].shape[-1]
    ref = results["xla"]
    scale = max(float(abs(ref[0])), 1.0)
    assert_close(loss, ref[0], "value", jnp.float32, v, name, scale=scale)
    assert_close(grad, ref[2], "grad", jnp.float32, v, name)


def test_sampler_logps_without_is_mode_change_nothing_but_the_aux():
  """sampler_logps alone is a metric: loss and gradient are bit for bit those without it, and an
  explicit LossSpec() equals the keyword defaults."""
  args, kw = make_problem(3, 5, 200, jnp.float32, off_policy=True, seed=13, beta=0.04)
  for name, call in IMPL_CALLS.items():
    plain = loss_and_grad(args, kw, **call)
    with_s = loss_and_grad(args, dict(kw, sampler_logps=kw["old_logps"] - 0.1), **call)
    np.testing.assert_array_equal(with_s[0], plain[0], err_msg=name)
    np.testing.assert_array_equal(with_s[2], plain[2], err_msg=name)
    slr = 0.1 * np.asarray(args[2], np.float32)
    np.testing.assert_allclose(with_s[1].sampler_log_ratio, slr, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(plain[1].is_weight, np.asarray(args[2], np.float32))
    spec = LossSpec(beta=kw["beta"])
    spec_kw = {k: v for k, v in kw.items() if k != "beta"}
    via_spec = loss_and_grad(args, dict(spec_kw, spec=spec), **call)
    for a, e in zip(jax.tree.leaves(via_spec), jax.tree.leaves(plain)):
      np.testing.assert_array_equal(a, e, err_msg=name)


# ------------------------------------------------------------------------------------ the spec
def test_loss_spec_is_hashable_and_normalised():
  assert LossSpec(beta=0) == LossSpec(beta=0.0) and hash(LossSpec(beta=0)) == hash(LossSpec())
  assert isinstance(LossSpec(epsilon_c=3).epsilon_c, float)
  assert LossSpec(is_mode="sequence_mask").sequence_level
  assert LossSpec(importance_sampling_level="sequence").sequence_level
  assert not LossSpec(is_mode="token_truncate", epsilon_c=2.0).sequence_level
  # a keyword that agrees with spec= is accepted (only a conflicting one is an error)
  args, _ = make_problem(1, 2, 10, jnp.float32, seed=1)
  spec = LossSpec(epsilon_c=2.0, loss_type="bnpo")
  a = kernels.grpo_loss(*args, spec=spec, epsilon_c=2, loss_type="bnpo", impl="xla")[0]
  np.testing.assert_array_equal(a, kernels.grpo_loss(*args, spec=spec, impl="xla")[0])


@pytest.mark.parametrize(
  "options,match",
  [
    (dict(is_cap=0.0), r"is_cap must be finite and in \(0, inf\)"),
    (dict(is_cap=-1.0), "is_cap"),
    (dict(epsilon_c=1.0), r"epsilon_c must be finite and in \(1, inf\)"),
    (dict(epsilon_c=0.5), "epsilon_c"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level must be one of"),
    (dict(is_mode="tis"), "is_mode must be one of"),
    (dict(loss_type="ppo"), "loss_type must be one of"),
    (dict(max_log_ratio=0.0), "max_log_ratio"),
    (dict(max_completion_length=0), "max_completion_length"),
  ],
)
def test_loss_spec_rejects_bad_values(options, match):
  with pytest.raises(ValueError, match=match):
    LossSpec(**options)
