"""Parity of the Pallas GRPO loss (both kernel families, in the interpreter) against the reference, on
seeded random problems, extreme-but-possible inputs and bad input."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import kernels
from bench.tolerances import assert_close
from kernels.grpo_loss import LossBlocks
from kernels.grpo_loss.reference import LOSS_TYPES, token_logps_and_entropy
from tests.problems import assert_loss_parity, epsilon_sensitive_tokens, loss_scale, policy_kwargs

# (platform, blocks maker): the tiled family as the CPU interpreter runs it, and the GPU rowloop family
# run through the interpreter, so the Triton kernel's arithmetic is checked without a GPU.
FAMILIES = {
  "tiled": ("cpu", lambda bn, bv: LossBlocks(bn, bv)),
  "rowloop": ("gpu", lambda bn, bv: LossBlocks(1, 1 << max(bv - 1, 1).bit_length())),
}
# Unequal epsilons in every option: a kernel that swaps or merges them must fail a parity test.
OPTIONS = {
  "on_policy": dict(epsilon_low=0.1, epsilon_high=0.3),
  "off_policy_temp": dict(off_policy=True, temperature=0.7, epsilon_low=0.15, epsilon_high=0.28),
  "kl": dict(off_policy=True, beta=0.04, temperature=1.3, epsilon_low=0.3, epsilon_high=0.1),
}


def make_problem(b, t, v, dtype, *, off_policy=False, beta=0.0, seed=0, empty_row=True, **options):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(b, t, v)) * 2.0, dtype)
  ids = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  mask = rng.random((b, t)) < 0.75
  if empty_row:
    mask[rng.integers(b)] = False
  logp, _ = token_logps_and_entropy(logits, ids, options.get("temperature", 1.0))
  kw = policy_kwargs(rng, logp, options, off_policy=off_policy, beta=beta)
  return (logits, ids, jnp.asarray(mask), jnp.asarray(rng.normal(size=b), jnp.float32)), kw


def loss_and_grad(args, kw, **call_kw):
  def f(x):
    return kernels.grpo_loss(x, *args[1:], **kw, **call_kw)

  (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(args[0])
  return loss, aux, grad


def pallas_kw(family, blocks=None):
  return dict(impl="pallas", platform=FAMILIES[family][0], interpret=True, blocks=blocks)


def assert_parity(args, kw, *, platform, blocks, loss_types=LOSS_TYPES):
  for loss_type in loss_types:
    ours = loss_and_grad(
      args, kw, loss_type=loss_type, impl="pallas", platform=platform, interpret=True, blocks=blocks
    )
    ref = loss_and_grad(args, kw, loss_type=loss_type, impl="xla")
    assert_loss_parity(ours, ref, args, kw, f"{loss_type} {platform} {blocks}")
  return ref


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
def test_parity_every_loss_type(family, dtype, option):
  platform, blocks = FAMILIES[family]
  args, kw = make_problem(4, 6, 300, dtype, seed=11, **OPTIONS[option])
  ref = assert_parity(args, kw, platform=platform, blocks=blocks(8, 128))
  if "old_logps" in kw:  # the data must be able to tell epsilon_low from epsilon_high
    assert epsilon_sensitive_tokens(ref[1], args[2], args[3], kw) > 0


@given(
  b=st.integers(1, 4),
  t=st.integers(1, 9),
  v=st.integers(1, 700),
  bn=st.integers(1, 16),
  bv=st.integers(1, 300),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  family=st.sampled_from(sorted(FAMILIES)),
  option=st.sampled_from(sorted(OPTIONS)),
  loss_type=st.sampled_from(LOSS_TYPES),
  seed=st.integers(0, 2**31 - 1),
)
def test_parity_ragged_shapes(b, t, v, bn, bv, dtype, family, option, loss_type, seed):
  platform, blocks = FAMILIES[family]
  args, kw = make_problem(b, t, v, dtype, seed=seed, **OPTIONS[option])
  assert_parity(args, kw, platform=platform, blocks=blocks(bn, bv), loss_types=(loss_type,))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vocab", [151936, 128256])
def test_parity_production_vocab(family, vocab):
  """Qwen and Llama-3 vocabularies with the default blocks: the masked vocab tail at full width."""
  platform, _ = FAMILIES[family]
  args, kw = make_problem(1, 3, vocab, jnp.bfloat16, off_policy=True, beta=0.04, empty_row=False)
  assert_parity(args, kw, platform=platform, blocks=None, loss_types=("grpo",))


def test_reuse_logits_buffer_same_gradient():
  args, kw = make_problem(2, 4, 200, jnp.float32)
  call = dict(impl="pallas", platform="cpu", blocks=LossBlocks(8, 128))
  a = loss_and_grad(args, kw, **call)
  b = loss_and_grad(args, kw, reuse_logits_buffer=True, **call)
  np.testing.assert_array_equal(a[2], b[2])


# ------------------------------------------------------------------------ gradients through aux
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("field", ["per_token_logps", "per_token_kl", "entropy"])
def test_gradient_through_aux_matches_reference(family, field):
  """GRPOAux documents per_token_logps and per_token_kl as differentiable and entropy as not: the
  kernel's custom VJP must pass (or drop) exactly those cotangents, like the reference's autodiff."""
  args, kw = make_problem(3, 5, 300, jnp.float32, off_policy=True, beta=0.04, seed=5)
  weights = jnp.asarray(np.random.default_rng(6).normal(size=args[1].shape), jnp.float32)

  def grad(**call_kw):
    def f(x):
      aux = kernels.grpo_loss(x, *args[1:], **kw, **call_kw)[1]
      return jnp.sum(weights * getattr(aux, field))

    return jax.grad(f)(args[0])

  ours, ref = grad(**pallas_kw(family, FAMILIES[family][1](8, 128))), grad(impl="xla")
  if field == "entropy":
    np.testing.assert_array_equal(ours, 0.0)
    np.testing.assert_array_equal(ref, 0.0)
  else:
    assert float(jnp.max(jnp.abs(ref))) > 0.1  # the aux field really carries a gradient
    assert_close(ours, ref, "grad", jnp.float32, 300, f"d {field} / dlogits")


# -------------------------------------------------------------------- extreme-but-possible inputs
IMPL_CALLS = {
  "xla": dict(impl="xla"),
  "tiled": pallas_kw("tiled", LossBlocks(8, 128)),
  "rowloop": pallas_kw("rowloop", LossBlocks(1, 128)),
}


def _every_impl(args, kw, **call_kw):
  return {name: loss_and_grad(args, kw, **c, **call_kw) for name, c in IMPL_CALLS.items()}


def _assert_finite_and_agree(results, args, kw, neg_inf_logp=None):
  """Every impl finite (per_token_logps may be -inf exactly where ``neg_inf_logp`` [B, T] says: the
  log-prob of a token whose logit is -inf) and within tolerance of the reference."""
  v = args[0].shape[-1]
  ref = results["xla"]
  for name, (loss, aux, grad) in results.items():
    for what, x in [("loss", loss), ("grad", grad), *zip(aux._fields, aux)]:
      x = np.asarray(x, np.float32)
      if what == "per_token_logps" and neg_inf_logp is not None:
        np.testing.assert_array_equal(x == -np.inf, neg_inf_logp, err_msg=name)
        x = np.where(neg_inf_logp, 0.0, x)
      assert np.isfinite(x).all(), f"{name}: non-finite {what}"
    if name == "xla":
      continue
    scale = max(loss_scale(ref[1], args[2], args[3], kw), float(abs(ref[0])))
    assert_close(loss, ref[0], "value", jnp.float32, v, f"{name} loss", scale=scale)
    for field, a, e in zip(aux._fields, aux, ref[1]):
      # token by token: one -inf or -3e38 log-prob must not set the scale of the others
      for idx in np.ndindex(e.shape):
        assert_close(a[idx], e[idx], "value", jnp.float32, v, f"{name} {field} {idx}")
    assert_close(grad, ref[2], "grad", args[0].dtype, v, f"{name} dlogits")


@pytest.mark.parametrize("option", ["on_policy", "kl"])
def test_minus_inf_logits_top_k_mask(option):
  """A top-k mask leaves -inf in every row: entropy uses 0 * log 0 = 0, everything stays finite."""
  args, kw = make_problem(3, 4, 300, jnp.float32, seed=7, **OPTIONS[option])
  logits, ids = args[0], args[1]
  kth = jnp.sort(logits, axis=-1)[..., -20:-19]  # keep the top 20 of each row
  keep = (logits >= kth) | (jnp.arange(300) == ids[..., None])  # the sampled token is always kept
  masked = jnp.where(keep, logits, -jnp.inf)
  _assert_finite_and_agree(_every_impl((masked, *args[1:]), kw), (masked, *args[1:]), kw)


@pytest.mark.parametrize("option", ["on_policy", "kl"])
def test_huge_logits_and_minus_inf_chosen_logit(option):
  """+-3e38 logits (a diverging model) and a -inf logit on the sampled token (a sampler that did not
  apply the trainer's mask): finite loss and gradient, logp = -inf for that token only, and xla and
  both kernel families agree. At temperature 1: logits / T of |x| ~ 1e38 keeps no precision (one
  ulp is 2e31, and a fused multiply-add sees the unrounded product), so T != 1 is not compared."""
  options = dict(OPTIONS[option], temperature=1.0)
  args, kw = make_problem(3, 4, 300, jnp.float32, seed=8, empty_row=False, **options)
  logits, ids = np.array(args[0]), np.asarray(args[1])
  logits[0, :, :5] = 3e38
  logits[1, :, :5] = -3e38
  logits[1, 0, ids[1, 0]] = -3e38
  logits[2, 1, ids[2, 1]] = -np.inf
  mask = jnp.ones(ids.shape, bool).at[0, 3].set(False)
  new = (jnp.asarray(logits), args[1], mask, args[3])
  neg_inf = np.zeros(ids.shape, bool)
  neg_inf[2, 1] = True
  _assert_finite_and_agree(_every_impl(new, kw), new, kw, neg_inf_logp=neg_inf)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_stale_sampler_log_ratio_is_clamped(beta):
  """old_logps = logp - 100 (a stale or mismatched sampler) and ref 100 nats off: the default clamp
  keeps the loss and gradient finite, identically in every impl; the ratio saturates at exp(20)."""
  args, kw = make_problem(3, 5, 300, jnp.float32, off_policy=True, beta=beta, seed=9)
  logp, _ = token_logps_and_entropy(args[0], args[1], 1.0)
  kw = dict(kw, old_logps=logp - 100.0)
  if beta:
    kw["ref_logps"] = logp + 100.0
  results = _every_impl(args, kw)
  _assert_finite_and_agree(results, args, kw)
  # Unclamped, the same input is what the knob exists for: an inf loss (or NaN gradient).
  loss, _, grad = loss_and_grad(args, kw, impl="xla", max_log_ratio=None)
  assert not (np.isfinite(loss) and np.isfinite(grad).all())


def test_nonfinite_values_at_masked_positions_never_reach_loss_or_gradient():
  """NaN / inf logits, old and ref log-probs at masked positions: loss, aux and gradient are exactly
  those of the same problem with clean values there, and the masked rows' gradient is exactly 0."""
  args, kw = make_problem(3, 5, 200, jnp.float32, off_policy=True, beta=0.04, seed=10)
  logits, ids, mask, adv = args
  masked = ~np.asarray(mask)
  assert masked.sum() >= 3
  bad = np.array(logits)
  bad[masked] = np.nan
  bad[np.nonzero(masked)[0][0], np.nonzero(masked)[1][0], :7] = np.inf
  poison = lambda a: jnp.where(jnp.asarray(masked), jnp.nan, a)
  bad_kw = dict(kw, old_logps=poison(kw["old_logps"]), ref_logps=poison(kw["ref_logps"]))
  bad_ids = jnp.where(jnp.asarray(masked), -100, ids)
  for name, call in IMPL_CALLS.items():
    for loss_type in ("grpo", "dr_grpo"):
      clean = loss_and_grad(args, kw, loss_type=loss_type, **call)
      dirty = loss_and_grad(
        (jnp.asarray(bad), bad_ids, mask, adv), bad_kw, loss_type=loss_type, **call
      )
      for a, e in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean)):
        np.testing.assert_array_equal(a, e, err_msg=f"{name} {loss_type}")
      np.testing.assert_array_equal(np.asarray(dirty[2])[masked], 0.0)


def test_default_clamp_is_bit_identical_where_inactive():
  """max_log_ratio=20 (the default) changes nothing, bit for bit, where |log ratio| < 20: against
  max_log_ratio=None in every impl, and against the pre-clamp reference formula (today's loss)."""
  args, kw = make_problem(3, 5, 300, jnp.float32, seed=12, **OPTIONS["kl"])
  for name, call in IMPL_CALLS.items():
    for loss_type in LOSS_TYPES:
      on = loss_and_grad(args, kw, loss_type=loss_type, **call)
      off = loss_and_grad(args, kw, loss_type=loss_type, max_log_ratio=None, **call)
      for a, e in zip(jax.tree.leaves(on[:2]), jax.tree.leaves(off[:2])):  # loss and aux
        np.testing.assert_array_equal(a, e, err_msg=f"{name} {loss_type}")
      # dlogits: bit-equal in xla; the kernels compute the token coefficient in-kernel (the two-pass
      # training path), where the compiler may contract a multiply-add differently once the clamp's
      # select is in the graph (1 ulp seen, tiled and rowloop), so within tolerance there.
      if name != "xla":
        assert_close(on[2], off[2], "grad", jnp.float32, 300, f"{name} {loss_type}")
      else:
        np.testing.assert_array_equal(on[2], off[2], err_msg=f"{name} {loss_type}")

  def todays_reference(x):  # kernels/grpo_loss/reference.py before the clamp (3a3c017), inlined
    logits, ids, mask, adv = x, args[1], args[2], args[3]
    z = logits.astype(jnp.float32) / kw["temperature"]
    logsm = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logsm, ids[..., None], axis=-1, mode="fill", fill_value=jnp.nan)[
      ..., 0
    ]
    ratio = jnp.exp(logp - kw["old_logps"])
    clipped = jnp.clip(ratio, 1.0 - kw["epsilon_low"], 1.0 + kw["epsilon_high"])
    per_token = -jnp.minimum(ratio * adv[:, None], clipped * adv[:, None])
    d = kw["ref_logps"] - logp
    per_token = per_token + kw["beta"] * (jnp.exp(d) - d - 1.0)
    per_seq = jnp.where(mask, per_token, 0.0).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
    return per_seq.mean()

  today, today_grad = jax.value_and_grad(todays_reference)(args[0])
  unmasked = np.asarray(args[2])
  spec = kernels.LossSpec(
    beta=kw["beta"],
    epsilon_low=kw["epsilon_low"],
    epsilon_high=kw["epsilon_high"],
    temperature=kw["temperature"],
  )
  logps = {k: kw[k] for k in ("old_logps", "ref_logps")}
  # keywords; an explicit LossSpec; sampler log-probs given without is_mode (a metric only): all are
  # today's loss and gradient, bit for bit
  for variant in (kw, dict(logps, spec=spec), dict(kw, sampler_logps=kw["old_logps"] - 0.3)):
    now, _, now_grad = loss_and_grad(args, variant, impl="xla")
    np.testing.assert_array_equal(now, today)
    np.testing.assert_array_equal(np.asarray(now_grad)[unmasked], np.asarray(today_grad)[unmasked])


# ------------------------------------------------------------------------------ values under jit
@pytest.mark.parametrize("impl", IMPL_CALLS)
def test_masked_ids_are_ignored_and_unmasked_bad_ids_poison_under_jit(impl):
  args, _kw = make_problem(2, 4, 50, jnp.float32, empty_row=False)
  logits, ids, mask, adv = args
  mask = mask.at[0, 0].set(False)
  call = functools.partial(kernels.grpo_loss, **IMPL_CALLS[impl])
  np.testing.assert_allclose(
    call(logits, ids.at[0, 0].set(-100), mask, adv)[0], call(logits, ids, mask, adv)[0], rtol=1e-6
  )
  # jit hides the values from the argument check: an unmasked bad id (above V, or negative, which
  # must not wrap around to V - 1) surfaces as a NaN loss, never as a number.
  f = jax.jit(lambda i: call(logits, i, mask.at[1, 0].set(True), adv)[0])
  for bad_id in (50, -1):
    assert np.isnan(f(ids.at[1, 0].set(bad_id))), bad_id


@pytest.mark.parametrize("impl", IMPL_CALLS)
def test_nonfinite_advantage_and_bad_dapo_count_give_nan_under_jit(impl):
  args, _kw = make_problem(2, 4, 50, jnp.float32, empty_row=False)
  logits, ids, mask, adv = args
  call = functools.partial(kernels.grpo_loss, **IMPL_CALLS[impl])
  f = jax.jit(lambda a: call(logits, ids, mask, a)[0])
  assert np.isnan(f(adv.at[0].set(jnp.nan)))
  g = jax.jit(lambda n: call(logits, ids, mask, adv, loss_type="dapo", num_items_in_batch=n)[0])
  assert np.isfinite(g(jnp.float32(5.0)))
  for count in (0.0, -3.0):
    assert np.isnan(g(jnp.float32(count))), count


def test_jit_does_not_recompile_for_new_values():
  # Counted as traces (a retrace is what a recompile costs first): the C++ cache size read 0 here after
  # other test modules had run, so it is not a property of this function alone.
  traces = []

  def loss(x, i, m, a):
    traces.append(x.shape)
    return kernels.grpo_loss(x, i, m, a, impl="pallas", platform="cpu")[0]

  f = jax.jit(loss)
  for seed in range(3):
    args, _ = make_problem(2, 3, 40, jnp.float32, seed=seed)
    f(*args)
  assert len(traces) == 1


# ----------------------------------------------------------------------------------- bad input
BAD_INPUTS = [
  (dict(logits=jnp.zeros((2, 3))), ValueError, r"logits must be \[B, T, V\]"),
  (dict(logits=jnp.zeros((2, 3, 5), jnp.int32)), TypeError, "logits must have a floating dtype"),
  (dict(logits=jnp.zeros((2, 3, 0))), ValueError, "empty vocabulary"),
  (dict(completion_ids=jnp.zeros((2, 4), jnp.int32)), ValueError, "completion_ids must have shape"),
  (dict(completion_ids=jnp.zeros((2, 3))), TypeError, "completion_ids must have a integer"),
  (
    dict(completion_ids=jnp.full((2, 3), 5)),
    ValueError,
    r"unmasked completion_ids outside \[0, 5\)",
  ),
  (dict(completion_ids=jnp.full((2, 3), -1)), ValueError, r"completion_ids outside \[0, 5\)"),
  (dict(completion_mask=jnp.ones((3, 2))), ValueError, "completion_mask must have shape"),
  (dict(advantages=jnp.ones((3,))), ValueError, "advantages must have shape"),
  (dict(advantages=jnp.array([1.0, jnp.nan])), ValueError, "advantages has 1 NaN or inf"),
  (dict(advantages=[1.0, float("inf")]), ValueError, "advantages has 1 NaN or inf"),
  (dict(old_logps=jnp.ones((2,))), ValueError, "old_logps must have shape"),
  (dict(old_logps=jnp.full((2, 3), jnp.nan)), ValueError, "old_logps has 6 NaN or \\+inf"),
  (dict(ref_logps=jnp.full((2, 3), jnp.inf), beta=0.1), ValueError, "ref_logps has 6 NaN"),
  (dict(beta=0.1), ValueError, "ref_logps is required"),
  (dict(beta=-0.1), ValueError, r"beta must be finite and in \[0, inf\)"),
  (dict(beta=float("nan")), ValueError, "beta must be finite"),
  (dict(beta="0.1"), TypeError, "beta must be a Python number"),
  (dict(beta=jnp.float32(0.1)), TypeError, "beta must be a Python number"),
  (dict(loss_type="ppo"), ValueError, "loss_type must be one of"),
  (dict(temperature=0.0), ValueError, r"temperature must be finite and in \(0, inf\)"),
  (dict(temperature=-1.0), ValueError, "temperature must be finite"),
  (dict(temperature=float("inf")), ValueError, "temperature must be finite"),
  (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
  (dict(epsilon_low=-0.1), ValueError, r"epsilon_low must be finite and in \[0, 1\)"),
  (dict(epsilon_low=1.0), ValueError, r"epsilon_low must be finite and in \[0, 1\)"),
  (dict(epsilon_low=1.5), ValueError, "epsilon_low"),
  (dict(epsilon_high=-0.1), ValueError, r"epsilon_high must be finite and in \[0, inf\)"),
  (dict(max_log_ratio=0.0), ValueError, r"max_log_ratio must be finite and in \(0, inf\)"),
  (dict(max_log_ratio=float("inf")), ValueError, "max_log_ratio"),
  (dict(impl="triton"), ValueError, "impl must be one of"),
  (dict(max_completion_length=0), ValueError, "max_completion_length must be a positive int"),
  (dict(max_completion_length=2.5), ValueError, "max_completion_length"),
  (dict(loss_type="dapo", num_items_in_batch=0), ValueError, r"num_items_in_batch must be .* > 0"),
  (dict(loss_type="dapo", num_items_in_batch=-4.0), ValueError, "num_items_in_batch"),
  (dict(loss_type="dapo", num_items_in_batch=float("nan")), ValueError, "num_items_in_batch"),
  (dict(loss_type="dapo", num_items_in_batch=jnp.ones(2)), ValueError, "must be a scalar"),
  # the LossSpec options and per-token advantages
  (dict(is_mode="token_truncate"), ValueError, "is_mode='token_truncate' needs sampler_logps"),
  (dict(is_mode="sequence_mask"), ValueError, "needs sampler_logps"),
  (dict(is_mode="tis", sampler_logps=jnp.zeros((2, 3))), ValueError, "is_mode must be one of"),
  (dict(is_cap=0.0), ValueError, r"is_cap must be finite and in \(0, inf\)"),
  (dict(is_cap=-2.0), ValueError, "is_cap"),
  (dict(epsilon_c=1.0), ValueError, r"epsilon_c must be finite and in \(1, inf\)"),
  (dict(epsilon_c=0.9), ValueError, "epsilon_c"),
  (dict(importance_sampling_level="seq"), ValueError, "importance_sampling_level must be one of"),
  (dict(sampler_logps=jnp.zeros((2,))), ValueError, "sampler_logps must have shape"),
  (dict(sampler_logps=jnp.zeros((3, 2))), ValueError, "sampler_logps must have shape"),
  (dict(sampler_logps=jnp.full((2, 3), jnp.nan)), ValueError, "sampler_logps has 6 NaN or inf"),
  (dict(sampler_logps=[[0.0, 0.0, float("-inf")]] * 2), ValueError, "sampler_logps has 2 NaN"),
  (dict(advantages=jnp.ones((2, 4))), ValueError, "advantages must have shape"),
  (dict(advantages=jnp.ones((2, 3, 1))), ValueError, "advantages must have shape"),
  (dict(advantages=jnp.full((2, 3), jnp.inf)), ValueError, "advantages has 6 NaN or inf"),
  (dict(spec=kernels.LossSpec(beta=0.0), beta=0.5), ValueError, "beta=0.5 conflicts with spec"),
  (dict(spec=kernels.LossSpec(), loss_type="dapo"), ValueError, "loss_type='dapo' conflicts"),
  (dict(spec="grpo"), TypeError, "spec must be a kernels.LossSpec"),
  (dict(spec=kernels.LossSpec(is_mode="token_mask")), ValueError, "needs sampler_logps"),
]


def _small_args(**kwargs):
  args = dict(
    logits=jnp.zeros((2, 3, 5)),
    completion_ids=jnp.zeros((2, 3), jnp.int32),
    completion_mask=jnp.ones((2, 3)),
    advantages=jnp.ones((2,)),
  )
  args.update(kwargs)
  positional = [args.pop(k) for k in ("logits", "completion_ids", "completion_mask", "advantages")]
  return positional, args


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("kwargs,error,match", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument(impl, kwargs, error, match):
  positional, kw = _small_args(**kwargs)
  kw.setdefault("impl", impl)
  with pytest.raises(error, match=match):
    kernels.grpo_loss(*positional, **kw, platform="cpu", interpret=True)


def test_type_errors_are_also_value_errors():
  """One `except ValueError` catches every rejected argument, wrong types included."""
  positional, kw = _small_args(completion_ids=jnp.zeros((2, 3)))
  with pytest.raises(ValueError):
    kernels.grpo_loss(*positional, **kw)


@pytest.mark.parametrize("impl", IMPL_CALLS)
def test_python_lists_are_accepted_by_every_impl(impl):
  args, kw = make_problem(2, 3, 40, jnp.float32, off_policy=True, empty_row=False)
  logits, ids, mask, adv = args
  as_arrays = kernels.grpo_loss(*args, **kw, **IMPL_CALLS[impl])[0]
  as_lists = kernels.grpo_loss(
    logits,
    np.asarray(ids).tolist(),
    np.asarray(mask).tolist(),
    np.asarray(adv).tolist(),
    old_logps=np.asarray(kw["old_logps"]).tolist(),
    **{k: v for k, v in kw.items() if k != "old_logps"},
    **IMPL_CALLS[impl],
  )[0]
  np.testing.assert_array_equal(as_lists, as_arrays)


def test_illegal_blocks_rejected_before_lowering():
  args, _kw = make_problem(2, 8, 1000, jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 128"):
    kernels.grpo_loss(*args, platform="tpu", blocks=LossBlocks(16, 100))
  with pytest.raises(ValueError, match="powers of two"):
    kernels.grpo_loss(*args, platform="gpu", blocks=LossBlocks(1, 100))
  with pytest.raises(ValueError, match="block_n must be 1"):
    kernels.grpo_loss(*args, platform="gpu", blocks=LossBlocks(4, 128))
  with pytest.raises(ValueError, match="positive int"):
    LossBlocks(0, 128)


@pytest.mark.parametrize("v,bv,splits", [(300, 64, 5), (300, 128, 3), (37, 16, 4), (1, 1, 3)])
def test_rowloop_split_rows_combine_exactly(v, bv, splits):
  """The rowloop statistics kernel with a row split across programs (LossBlocks.splits): partial
  max / sum-exp / entropy sums combined by log-sum-exp equal the reference — with a split that is
  empty (37 = 2 x 16 + 5 over 4 splits), a first half of -inf logits (a split of only -inf), a
  masked NaN row and, under jit, an out-of-range id that must poison. Forward values, and a GSPO
  gradient (the sequence-level three-pass path runs this kernel first)."""
  args, kw = make_problem(2, 3, v, jnp.float32, seed=4, off_policy=True, beta=0.04)
  x = args[0].at[0, 0, : v // 2].set(-jnp.inf)
  x = jnp.where(args[2][..., None], x, jnp.nan)  # masked rows: NaN logits
  call = pallas_kw("rowloop", LossBlocks(1, bv, splits=splits))
  ours, ref = kernels.grpo_loss(x, *args[1:], **kw, **call), kernels.grpo_loss(x, *args[1:], **kw)
  for name in ("per_token_logps", "entropy", "per_token_kl"):
    assert_close(getattr(ours[1], name), getattr(ref[1], name), "value", jnp.float32, v, name)
  assert_close(ours[0], ref[0], "value", jnp.float32, v, "loss")
  gspo = dict(kw, importance_sampling_level="sequence")
  grad = lambda **c: jax.grad(lambda y: kernels.grpo_loss(y, *args[1:], **gspo, **c)[0])(x)
  assert_close(grad(**call), grad(impl="xla"), "grad", jnp.float32, v, "GSPO dlogits")
  if v > 1:
    bad = args[1].at[1, 0].set(v)
    mask = jnp.ones_like(args[2])
    f = jax.jit(lambda i: kernels.grpo_loss(args[0], i, mask, args[3], **kw, **call)[0])
    assert np.isnan(f(bad)) and np.isfinite(f(args[1]))
