"""The update step: micro-batching is exact (global normalisation), kernel and reference losses agree
through the whole model, the optimizer state keeps its layout (no recompiles)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.tolerances import assert_close
from kernels import LossSpec
from rl import optimizer as O
from rl import update as U
from rl.mismatch import mismatch_metrics
from rl.model import init_model, preset, shard_model
from rl.sharding import make_mesh
from rl.update import pack
from tests.compiles import compile_events
from tests.problems import policy_kwargs

P, C = 7, 6


def _problem(seed: int, n: int = 8):
  """A tiny model and a batch of n rows with ragged prompts / completions (one completion empty)."""
  rng = np.random.default_rng(seed)
  model = init_model(preset("tiny", dtype="float32"), seed)
  prompts = [rng.integers(0, 300, rng.integers(1, P + 1)) for _ in range(n)]
  comps = [rng.integers(0, 300, rng.integers(0, C + 1)) for _ in range(n)]
  comps[1] = comps[1][:0]
  tokens, mask = pack(prompts, comps, P, C, pad_id=0)
  adv = rng.normal(size=n).astype(np.float32)
  return model, rng, tokens, mask, adv


def _batch(tokens, mask, adv, k, **extra):
  shape = lambda x: None if x is None else jnp.asarray(x).reshape(k, x.shape[0] // k, *x.shape[1:])
  return U.Batch(shape(tokens), shape(mask), shape(adv), **{n: shape(v) for n, v in extra.items()})


def _grads(model, batch, settings, objective="grpo"):
  graphdef, params = nnx.split(model, nnx.Param)
  grads, metrics = jax.jit(U.batch_loss_and_grads, static_argnums=(0, 3, 4))(
    graphdef, params, batch, settings, objective
  )
  return jax.tree.leaves(grads), metrics


def _assert_grads_close(a, b, n_tokens):
  for x, y in zip(a, b):
    assert_close(x, y, "grad", jnp.float32, n_tokens, scale=float(max(np.max(np.abs(y)), 1e-6)))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_the_global_batch_loss(loss_type):
  """K = 1, 2, 4 accumulation steps give the same loss and gradients: normalised over the global batch."""
  model, rng, tokens, mask, adv = _problem(1)
  s = U.LossSettings(C, LossSpec(loss_type=loss_type, beta=0.05), impl="xla")
  logp = np.asarray(U.token_logps(model, jnp.asarray(tokens), jnp.asarray(mask), C, 1.0))
  kw = policy_kwargs(rng, logp, {}, off_policy=True, beta=0.05)
  extra = dict(old_logps=np.asarray(kw["old_logps"]), ref_logps=np.asarray(kw["ref_logps"]))
  g1, m1 = _grads(model, _batch(tokens, mask, adv, 1, **extra), s)
  for k in (2, 4):
    gk, mk = _grads(model, _batch(tokens, mask, adv, k, **extra), s)
    assert_close(mk["loss"], m1["loss"], "value", jnp.float32, tokens.size)
    _assert_grads_close(gk, g1, tokens.size)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "old_logps"])
def test_mismatch_metrics_of_the_sampler_logps(off_policy):
  """With the engine's log-probs in the batch the step reports rl.mismatch's statistics against the
  loss's `old` (the trainer's own forward on-policy, else old_logps), the same for K = 1, 2, 4
  micro-batches (a max is not summed), and the loss and gradients do not change."""
  model, rng, tokens, mask, adv = _problem(4)
  s = U.LossSettings(C, impl="xla")
  logp = np.asarray(U.token_logps(model, jnp.asarray(tokens), jnp.asarray(mask), C, 1.0))
  comp_mask = mask[:, -C:]
  sampler = np.where(comp_mask, logp + rng.normal(scale=0.3, size=logp.shape), 0.0)
  old = np.where(comp_mask, logp + rng.normal(scale=0.1, size=logp.shape), 0.0)
  extra = dict(old_logps=old.astype(np.float32)) if off_policy else {}
  want = mismatch_metrics(sampler, old if off_policy else logp, comp_mask)
  g0, m0 = _grads(model, _batch(tokens, mask, adv, 1, **extra), s)
  for k in (1, 2, 4):
    g, m = _grads(model, _batch(tokens, mask, adv, k, sampler_logps=sampler, **extra), s)
    assert set(want) <= set(m)
    for key, value in want.items():
      assert_close(m[key], value, "value", jnp.float32, tokens.size, err_msg=f"K={k} {key}")
    assert_close(m["loss"], m0["loss"], "value", jnp.float32, tokens.size)
    _assert_grads_close(g, g0, tokens.size)
  assert not any(key.startswith("mismatch") for key in m0)  # no sampler log-probs: no statistics


@pytest.mark.parametrize(
  "is_mode, level", [("token_truncate", "token"), ("sequence_mask", "sequence")]
)
def test_importance_corrected_loss_micro_batches_and_weights(is_mode, level):
  """With TIS / MIS (and GSPO) on, bnpo: K = 1 and 4 micro-batches give the same loss and gradients
  (sequence-level weights stay within a row), the weights act (the loss differs from the uncorrected
  one), and the step's is_weight statistics are those of the weights computed by hand."""
  model, rng, tokens, mask, adv = _problem(5)
  cap = 1.1
  spec = LossSpec(loss_type="bnpo", is_mode=is_mode, is_cap=cap, importance_sampling_level=level)
  logp = np.asarray(U.token_logps(model, jnp.asarray(tokens), jnp.asarray(mask), C, 1.0))
  m = mask[:, -C:]
  old = np.where(m, logp + rng.normal(scale=0.05, size=logp.shape), 0.0).astype(np.float32)
  sampler = np.where(m, old + rng.normal(scale=0.1, size=logp.shape), 0.0).astype(np.float32)
  r = np.where(m, old.astype(np.float64) - sampler, 0.0)
  if level == "token":
    w = np.minimum(np.exp(r), cap)
  else:
    rho = np.exp(r.sum(axis=1, keepdims=True)) * np.ones_like(r)
    w = np.where(rho <= cap, rho, 0.0)
  flagged = np.where(m, ~np.isclose(w, np.exp(r) if level == "token" else rho), False)
  assert 0 < flagged.sum() < m.sum()  # the case truncates / masks some tokens, not all
  extra = dict(old_logps=old, sampler_logps=sampler)
  g1, m1 = _grads(model, _batch(tokens, mask, adv, 1, **extra), U.LossSettings(C, spec))
  want = mismatch_metrics(sampler, old, m, np.where(m, w, 0.0), is_level=level)
  for key in ("mismatch/is_weight_mean", "mismatch/masked_or_truncated_fraction"):
    assert_close(m1[key], want[key], "value", jnp.float32, tokens.size, err_msg=key)
  assert_close(
    m1["mismatch/masked_or_truncated_fraction"], flagged.sum() / m.sum(), "value", jnp.float32, 1
  )
  g4, m4 = _grads(model, _batch(tokens, mask, adv, 4, **extra), U.LossSettings(C, spec))
  # the loss is a sum of +-|A| w terms that nearly cancel: rounding is relative to the terms
  terms = float(np.abs(adv).max()) * cap
  assert_close(m4["loss"], m1["loss"], "value", jnp.float32, tokens.size, scale=terms)
  _assert_grads_close(g4, g1, tokens.size)
  plain = dataclasses.replace(spec, is_mode=None)
  _, m0 = _grads(model, _batch(tokens, mask, adv, 1, **extra), U.LossSettings(C, plain))
  assert abs(float(m0["loss"]) - float(m1["loss"])) > 1e-4
  assert "mismatch/is_weight_mean" not in m0 and "mismatch/k3_kl" in m0


def test_micro_batch_loss_is_not_a_mean_of_micro_batch_means():
  """The test above can fail: per-micro-batch bnpo normalisation gives a different loss."""
  model, _, tokens, mask, adv = _problem(2)
  _, full = _grads(
    model, _batch(tokens, mask, adv, 1), U.LossSettings(C, LossSpec(loss_type="bnpo"), impl="xla")
  )
  halves = [
    _grads(
      model,
      _batch(tokens[i : i + 4], mask[i : i + 4], adv[i : i + 4], 1),
      U.LossSettings(C, LossSpec(loss_type="bnpo"), impl="xla"),
    )[1]["loss"]
    for i in (0, 4)
  ]
  assert abs(float(np.mean(halves)) - float(full["loss"])) > 1e-4


@pytest.mark.parametrize(
  "fused,impls", [(False, ("pallas", "xla")), (True, ("pallas", "chunked", "xla"))]
)
def test_kernel_and_reference_losses_agree_through_the_model(fused, impls):
  """policy_loss_impl=pallas vs xla (and the fused LM-head paths): same loss, metrics and parameter
  gradients on the same batch, off-policy with the KL term on."""
  model, rng, tokens, mask, adv = _problem(3)
  logp = np.asarray(U.token_logps(model, jnp.asarray(tokens), jnp.asarray(mask), C, 0.9))
  kw = policy_kwargs(rng, logp, {}, off_policy=True, beta=0.1)
  batch = _batch(
    tokens,
    mask,
    adv,
    2,
    old_logps=np.asarray(kw["old_logps"]),
    ref_logps=np.asarray(kw["ref_logps"]),
  )
  results = {
    impl: _grads(
      model,
      batch,
      U.LossSettings(C, LossSpec(beta=0.1, temperature=0.9), impl=impl, fused_lm_head=fused),
    )
    for impl in impls
  }
  g_ref, m_ref = results["xla"]
  for impl in impls[:-1]:
    g, m = results[impl]
    for key in ("loss", "entropy", "kl", "clip_fraction"):
      assert_close(m[key], m_ref[key], "value", jnp.float32, tokens.size, err_msg=f"{impl} {key}")
    _assert_grads_close(g, g_ref, tokens.size)


def test_sft_objective_is_the_token_mean_nll():
  model, _, tokens, mask, _ = _problem(4)
  _, m = _grads(model, _batch(tokens, mask, np.ones(8, np.float32), 2), U.LossSettings(C), "sft")
  logp = U.token_logps(model, jnp.asarray(tokens), jnp.asarray(mask), C, 1.0)
  expected = -float(jnp.sum(logp)) / float(mask[:, -C:].sum())
  assert_close(m["loss"], expected, "value", jnp.float32, tokens.size)


@pytest.mark.parametrize("name,fused", [("adamw", True), ("adamw", False), ("lion", True)])
def test_train_step_descends_and_does_not_recompile(name, fused):
  """Steps on one batch lower the SFT loss; the second and third steps reuse the first executable."""
  model, _, tokens, mask, _ = _problem(5)
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.state(shard_model(model, mesh), nnx.Param)
  opt = O.make_optimizer(name, 3e-3, 0.0, 1.0, fused)
  state = O.init_optimizer_state(opt, params, mesh)
  step = U.compile_train_step(
    graphdef, opt, U.LossSettings(C), "sft", (O.shardings_of(params), O.shardings_of(state))
  )
  batch = _batch(tokens, mask, np.ones(8, np.float32), 2)
  params, state, m = step(params, state, batch)  # compiles
  losses = [float(m["loss"])]
  with compile_events() as compiles:
    for _ in range(2):
      params, state, m = step(params, state, batch)
      losses.append(float(m["loss"]))
  assert losses[2] < losses[0]
  assert not compiles, compiles


def _sft_step(fused: bool, learning_rate=3e-3):  # a float or an optax schedule
  model, _, tokens, mask, _ = _problem(6)
  graphdef, params = nnx.split(model, nnx.Param)
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  params = nnx.state(shard_model(model, mesh), nnx.Param)
  opt = O.make_optimizer("adamw", learning_rate, 0.01, 1.0, fused)
  state = O.init_optimizer_state(opt, params, mesh)
  step = U.compile_train_step(
    graphdef, opt, U.LossSettings(C), "grpo", (O.shardings_of(params), O.shardings_of(state))
  )
  return step, params, state, tokens, mask


def _host(tree):
  return [np.array(x) for x in jax.tree.leaves(tree)]  # copies: the step donates its inputs


@pytest.mark.parametrize("fused", [True, False])
def test_non_finite_step_leaves_weights_and_optimizer_state_untouched(fused):
  """A NaN advantage (a poisoned batch) makes the loss NaN: the step returns the weights and the
  optimizer state bit for bit, flags `nonfinite`, and the next finite batch updates as usual, with
  the same executable."""
  step, params, state, tokens, mask = _sft_step(fused)
  adv = np.random.default_rng(7).normal(size=8).astype(np.float32)
  poisoned = adv.copy()
  poisoned[3] = np.nan
  before_p, before_s = _host(params), _host(state)
  params, state, m = step(params, state, _batch(tokens, mask, poisoned, 2))
  assert float(m["nonfinite"]) == 1.0 and not np.isfinite(float(m["loss"]))
  for got, want in zip(_host(params) + _host(state), before_p + before_s):
    np.testing.assert_array_equal(got, want)
  with compile_events() as compiles:
    params, state, m = step(params, state, _batch(tokens, mask, adv, 2))
  assert float(m["nonfinite"]) == 0.0 and np.isfinite(float(m["loss"]))
  assert any(not np.array_equal(a, b) for a, b in zip(_host(params), before_p))
  assert not compiles, compiles


@pytest.mark.parametrize("fused", [True, False])
def test_warmup_schedule_scales_the_first_updates(fused):
  """Adam's first update moves a weight by about lr whatever its gradient: with a 4-step warm-up it
  moves by lr / 4 (a schedule read at count + 1 would give 1/2, one read at count would give 0), and
  the second by lr / 2 of the same optimizer. Same batch, same start, so only the rate differs."""
  adv = np.random.default_rng(9).normal(size=8).astype(np.float32)
  deltas = {}
  for name, rate in (("constant", 3e-3), ("warmup", O.warmup_schedule(3e-3, 4))):
    step, params, state, tokens, mask = _sft_step(fused, rate)
    start = _host(params)
    params, state, _ = step(params, state, _batch(tokens, mask, adv, 2))
    first = _host(params)
    params, state, _ = step(params, state, _batch(tokens, mask, adv, 2))
    deltas[name] = [
      np.concatenate([np.ravel(b - a) for a, b in zip(x, y)])
      for x, y in ((start, first), (first, _host(params)))
    ]
  const, warm = deltas["constant"][0], deltas["warmup"][0]
  big = np.abs(const) > 1e-3  # leaves Adam moved by ~lr (weight decay is 1e-2 x lr: negligible)
  assert big.mean() > 0.5
  np.testing.assert_allclose(warm[big] / const[big], 0.25, rtol=0.02)
  # The second update: Adam's moments now differ between the runs, so compare the rate's scale only.
  ratio = np.median(np.abs(deltas["warmup"][1][big]) / np.abs(deltas["constant"][1][big]))
  assert 0.35 < ratio < 0.7, ratio
  assert O.warmup_schedule(3e-3, 0) == 3e-3
  with pytest.raises(ValueError, match="warmup_steps and decay_steps must be >= 0"):
    O.warmup_schedule(3e-3, -1)


def test_warmup_cosine_schedule_by_hand():
  """4 warm-up updates to the peak, then a cosine to a tenth of it at update 12, held after."""
  rate = O.warmup_schedule(1.0, 4, 12)
  got = [float(rate(k)) for k in (0, 3, 4, 8, 12, 20)]
  np.testing.assert_allclose(got, [0.25, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)
  decay_only = O.warmup_schedule(1.0, 0, 10)
  np.testing.assert_allclose(
    [float(decay_only(k)) for k in (0, 5, 10)], [1.0, 0.55, 0.1], rtol=1e-6
  )


def test_update_that_overflows_the_weights_is_skipped():
  """Finite loss and gradients but an infinite learning rate: the new weights would be inf, so the
  step is skipped too (the guard looks at the result, not only at the inputs). A concrete inf rate
  is refused by the optimizer's own check; a schedule's value is traced, so it reaches the step."""
  step, params, state, tokens, mask = _sft_step(fused=True, learning_rate=lambda count: jnp.inf)
  adv = np.random.default_rng(8).normal(size=8).astype(np.float32)
  before = _host(params)
  params, state, m = step(params, state, _batch(tokens, mask, adv, 2))
  assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
  assert float(m["nonfinite"]) == 1.0
  for got, want in zip(_host(params), before):
    np.testing.assert_array_equal(got, want)


def test_non_finite_guard_counts_and_stops_after_n_in_a_row():
  guard = U.NonFiniteGuard(3)
  for skipped in (True, True, False, True, True):
    guard.update(skipped)
    guard.check(0)  # never 3 in a row yet
  assert (guard.total, guard.in_a_row) == (4, 2)
  guard.update(True)
  with pytest.raises(U.NonFiniteError, match=r"3 steps in a row.*max_nonfinite_steps=3"):
    guard.check(6)
  with pytest.raises(ValueError, match="max_in_a_row"):
    U.NonFiniteGuard(0)


@pytest.mark.parametrize("remat", ["layer", "full"])
def test_rematerialised_layers_give_the_same_loss_and_gradients(remat):
  """train.remat recomputes the decoder layers in the backward: the loss and every gradient match the
  stored-activation step (K = 2 micro-batches, KL and an old policy on). Catches a checkpointed layer
  body that drops its inputs (positions, mask) or its cache, or a policy that changes the math."""
  model, rng, tokens, mask, adv = _problem(6)
  spec = LossSpec(loss_type="dapo", beta=0.05)
  logp = np.asarray(U.token_logps(model, jnp.asarray(tokens), jnp.asarray(mask), C, 1.0))
  kw = policy_kwargs(rng, logp, {}, off_policy=True, beta=0.05)
  extra = dict(old_logps=np.asarray(kw["old_logps"]), ref_logps=np.asarray(kw["ref_logps"]))
  batch = _batch(tokens, mask, adv, 2, **extra)
  g0, m0 = _grads(model, batch, U.LossSettings(C, spec, impl="xla"))
  g1, m1 = _grads(model, batch, U.LossSettings(C, spec, impl="xla", remat=remat))
  assert_close(m1["loss"], m0["loss"], "value", jnp.float32, tokens.size)
  _assert_grads_close(g1, g0, tokens.size)


def test_remat_setting_is_checked():
  model = init_model(preset("tiny", dtype="float32"), 0)
  with pytest.raises(ValueError, match="remat must be one of"):
    model(jnp.zeros((1, 4), jnp.int32), remat="some")
