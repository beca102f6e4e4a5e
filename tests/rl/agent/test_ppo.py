"""PPO pieces: GAE against a hand-computed example, whitening, the clipped value loss and the
per-token-advantage policy loss against float64 references (values and gradients), parity with
kernels.grpo_loss when the advantages are per sequence, and no gradient on environment tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from rl.agent import ppo
from rl.agent.critic import ValueHead
from rl.model import init_model, preset
from rl.rollout.multiturn import ENV, MODEL, PROMPT, Episode, pack_episodes
from rl.update import completion_hidden


# ------------------------------------------------------------------------------------------ GAE
def test_gae_hand_computed():
  """Row 0: two turns (model tokens 0-1 and 4-5) around two environment tokens whose values (9) must
  be skipped; gamma = lambda = 0.5. By hand, over the model tokens k0..k3 (V = .5 .2 .4 .1, r = 0 1 0 2):
    k3: delta = 2 - .1 = 1.9                      A = 1.9
    k2: delta = .5*.1 - .4 = -.35                 A = -.35 + .25*1.9 = .125
    k1: delta = 1 + .5*.4 - .2 = 1.0              A = 1.0 + .25*.125 = 1.03125
    k0: delta = .5*.2 - .5 = -.4                  A = -.4 + .25*1.03125 = -.1421875
  Row 1: no model tokens. Row 2: padding after three model tokens."""
  mask = np.array([[1, 1, 0, 0, 1, 1], [0] * 6, [1, 1, 1, 0, 0, 0]], bool)
  values = np.array([[0.5, 0.2, 9, 9, 0.4, 0.1], [3] * 6, [0.1, 0.2, 0.3, 7, 7, 7]], np.float32)
  rewards = np.array([[0, 1, 0, 0, 0, 2], [0] * 6, [0, 0, 1, 0, 0, 0]], np.float32)
  adv, ret = ppo.gae(rewards, values, mask, gamma=0.5, lam=0.5)
  want = [-0.1421875, 1.03125, 0, 0, 0.125, 1.9]
  np.testing.assert_allclose(adv[0], want, atol=1e-6)
  np.testing.assert_allclose(ret[0], [0.3578125, 1.23125, 0, 0, 0.525, 2.0], atol=1e-6)
  assert (np.asarray(adv[1]) == 0).all() and (np.asarray(ret[1]) == 0).all()
  # row 2 by hand: k2: 1 - .3 = .7; k1: .5*.3 - .2 + .25*.7 = .125; k0: .5*.2 - .1 + .25*.125
  np.testing.assert_allclose(adv[2], [0.03125, 0.125, 0.7, 0, 0, 0], atol=1e-6)


def test_gae_gamma_lambda_one_is_the_return_minus_value():
  rng = np.random.default_rng(0)
  mask = rng.random((4, 12)) < 0.6
  values = rng.normal(size=(4, 12)).astype(np.float32)
  rewards = np.where(mask, rng.normal(size=(4, 12)), 0).astype(np.float32)
  adv, ret = ppo.gae(rewards, values, mask, gamma=1.0, lam=1.0)
  togo = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]  # sum of this and later rewards
  np.testing.assert_allclose(np.asarray(adv)[mask], (togo - values)[mask], atol=1e-5)
  np.testing.assert_allclose(np.asarray(ret)[mask], togo[mask], atol=1e-5)


def test_gae_bad_arguments():
  z = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match="gamma"):
    ppo.gae(z, z, z > 0, gamma=1.5, lam=0.9)
  with pytest.raises(ValueError, match="lam"):
    ppo.gae(z, z, z > 0, gamma=0.9, lam=-0.1)
  with pytest.raises(ValueError, match="one shape"):
    ppo.gae(z, np.zeros((2, 4)), z > 0, gamma=0.9, lam=0.9)


def test_whiten():
  rng = np.random.default_rng(1)
  x = rng.normal(3.0, 5.0, size=(3, 10)).astype(np.float32)
  mask = rng.random((3, 10)) < 0.7
  w = np.asarray(ppo.whiten(x, mask))
  assert abs(w[mask].mean()) < 1e-5 and abs(w[mask].std() - 1) < 1e-4
  assert (w[~mask] == 0).all()
  assert (np.asarray(ppo.whiten(np.ones((2, 3)), np.ones((2, 3), bool))) == 0).all()


# ------------------------------------------------------------------------------------------ value loss
def _value_loss_f64(v, old, ret, mask, clip):
  v, old, ret = (np.asarray(a, np.float64) for a in (v, old, ret))
  plain = (v - ret) ** 2
  if clip is None:
    per, dper = 0.5 * plain, v - ret
  else:
    vc = old + np.clip(v - old, -clip, clip)
    clipped = (vc - ret) ** 2
    per = 0.5 * np.maximum(plain, clipped)
    inside = np.abs(v - old) < clip
    dper = np.where(clipped > plain, np.where(inside, vc - ret, 0.0), v - ret)
  return np.where(mask, per, 0), np.where(mask, dper, 0)


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_against_float64(clip):
  rng = np.random.default_rng(2)
  shape = (5, 16)
  old = rng.normal(size=shape).astype(np.float32)
  v = (old + rng.normal(scale=0.4, size=shape)).astype(np.float32)
  ret = rng.normal(size=shape).astype(np.float32)
  mask = rng.random(shape) < 0.8
  per, dper = _value_loss_f64(v, old, ret, mask, clip)
  got, clipped = ppo.value_loss(jnp.asarray(v), old, ret, mask, clip)
  np.testing.assert_allclose(got, per, rtol=1e-5, atol=1e-6)
  if clip is not None:
    assert 0 < np.asarray(clipped).sum() < mask.sum()  # both branches exercised
  grad = jax.grad(lambda x: ppo.value_loss(x, old, ret, mask, clip)[0].sum())(jnp.asarray(v))
  np.testing.assert_allclose(grad, dper, rtol=1e-5, atol=1e-6)


def test_explained_variance():
  rng = np.random.default_rng(3)
  ret = rng.normal(size=(4, 8)).astype(np.float32)
  mask = np.ones((4, 8), bool)
  assert float(ppo.explained_variance(ret, ret, mask)) == pytest.approx(1.0)
  assert float(ppo.explained_variance(np.zeros_like(ret), ret - ret.mean(), mask)) == pytest.approx(
    0.0, abs=1e-6
  )
  assert float(ppo.explained_variance(ret, np.ones_like(ret), mask)) == 0.0  # constant returns


# ------------------------------------------------------------------------------------------ policy loss
def _policy_f64(logits, ids, mask, adv, old, eps_lo, eps_hi, loss_type):
  """Loss and d loss / d logits in float64 (the unclipped branch carries the gradient)."""
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = np.take_along_axis(logsm, ids[..., None], -1)[..., 0]
  ratio = np.exp(logp - old)
  a = np.asarray(adv, np.float64)
  unclipped, clipped = ratio * a, np.clip(ratio, 1 - eps_lo, 1 + eps_hi) * a
  per = -np.minimum(unclipped, clipped)
  grad_active = unclipped <= clipped  # min picks the unclipped term
  dper_dlogp = np.where(grad_active, -ratio * a, 0.0)
  if loss_type == "grpo":
    w = mask / np.maximum(mask.sum(-1, keepdims=True), 1) / mask.shape[0]
  else:  # dapo / bnpo: the mean over every masked token
    w = mask / max(mask.sum(), 1)
  loss = (per * w).sum()
  onehot = np.eye(z.shape[-1])[ids]
  dlogits = (w * dper_dlogp)[..., None] * (onehot - np.exp(logsm))
  return loss, dlogits


@pytest.mark.parametrize("impl", ["xla", "pallas"])  # pallas: the kernel, interpreted on CPU
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_policy_loss_against_float64(loss_type, impl):
  rng = np.random.default_rng(4)
  b, t, v = 3, 7, 11
  logits = rng.normal(size=(b, t, v)).astype(np.float32)
  ids = rng.integers(0, v, size=(b, t)).astype(np.int32)
  mask = rng.random((b, t)) < 0.75
  adv = rng.normal(size=(b, t)).astype(np.float32)  # per token: varies along t
  logsm = jax.nn.log_softmax(jnp.asarray(logits))
  true = np.take_along_axis(np.asarray(logsm), ids[..., None], -1)[..., 0]
  old = (true + rng.normal(scale=0.5, size=(b, t))).astype(np.float32)  # off-policy: clipping bites
  want, dwant = _policy_f64(logits, ids, mask, adv, old, 0.2, 0.3, loss_type)

  def f(x):
    kw = dict(epsilon_low=0.2, epsilon_high=0.3, loss_type=loss_type, impl=impl)
    return ppo.policy_loss(x, ids, mask, adv, old_logps=old, **kw)

  (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logits))
  assert 0 < np.asarray(aux.is_clipped).sum() < mask.sum()
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, dwant, rtol=1e-4, atol=1e-6)
  # the per-token advantage matters: the per-row mean gives a different loss
  mean_adv = np.broadcast_to(adv.mean(1, keepdims=True), adv.shape)
  other, _ = ppo.policy_loss(jnp.asarray(logits), ids, mask, mean_adv, old_logps=old)
  assert abs(float(other) - float(loss)) > 1e-3


def test_per_token_path_matches_the_per_sequence_kernel():
  """With an advantage constant along each row, the [B, T] path equals kernels.grpo_loss with [B]
  advantages exactly (values and gradients), for every reduction."""
  rng = np.random.default_rng(5)
  b, t, v = 4, 6, 9
  logits = jnp.asarray(rng.normal(size=(b, t, v)), jnp.float32)
  ids = rng.integers(0, v, size=(b, t)).astype(np.int32)
  mask = rng.random((b, t)) < 0.7
  adv_b = rng.normal(size=b).astype(np.float32)
  old = rng.normal(-2.3, 0.5, size=(b, t)).astype(np.float32)
  adv_bt = np.repeat(adv_b[:, None], t, 1)
  for loss_type in ("grpo", "bnpo", "dr_grpo"):
    kw = dict(old_logps=old, loss_type=loss_type)
    mine = jax.value_and_grad(lambda x, kw=kw: ppo.policy_loss(x, ids, mask, adv_bt, **kw)[0])
    ref = jax.value_and_grad(
      lambda x, kw=kw: kernels.grpo_loss(x, ids, mask, adv_b, impl="xla", **kw)[0]
    )
    mine, ref = mine(logits), ref(logits)
    np.testing.assert_allclose(mine[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(mine[1], ref[1], rtol=1e-6, atol=1e-8)


def test_policy_loss_bad_input():
  logits = jnp.zeros((2, 3, 5))
  ids, mask = np.zeros((2, 3), np.int32), np.ones((2, 3), bool)
  with pytest.raises(ValueError, match="advantages"):
    ppo.policy_loss(logits, ids, mask, np.zeros(2, np.float32))
  with pytest.raises(ValueError, match="epsilon_low"):
    ppo.policy_loss(logits, ids, mask, np.zeros((2, 3), np.float32), epsilon_low=1.5)
  with pytest.raises(ValueError, match="completion_ids"):
    ppo.policy_loss(logits, ids + 7, mask, np.zeros((2, 3), np.float32))


# ------------------------------------------------------------------------------------------ masks
def _episode(rng, prompt, turns):
  """An episode with `turns` (model, env) token counts; the last turn has no observation."""
  toks = list(rng.integers(0, 256, size=prompt))
  roles, spans, rewards = [PROMPT] * prompt, [], []
  for k, (m, e) in enumerate(turns):
    spans.append((len(toks), len(toks) + m))
    toks += list(rng.integers(0, 256, size=m))
    roles += [MODEL] * m
    rewards.append(float(k + 1))
    if e:
      toks += list(rng.integers(0, 256, size=e))
      roles += [ENV] * e
  logps = [-1.0 if r == MODEL else 0.0 for r in roles]
  return Episode(0, 0, [int(x) for x in toks], roles, logps, spans, rewards)


def test_environment_and_prompt_tokens_get_no_gradient():
  """Through the whole PPO objective (policy + value term, GAE advantages) on packed multi-turn rows:
  d loss / d logits and d loss / d value are 0 exactly at prompt, environment and padding positions
  and non-zero at model tokens."""
  rng = np.random.default_rng(6)
  episodes = [
    _episode(rng, 5, [(3, 4), (2, 3), (4, 0)]),
    _episode(rng, 8, [(6, 0)]),
    _episode(rng, 3, [(2, 5), (3, 0)]),
  ]
  packed = pack_episodes(episodes, 8, 20, 0)
  model = init_model(preset("tiny", dtype="float32"), seed=1)
  head = ValueHead(model.cfg.hidden_size)
  head.proj.kernel[...] = jnp.asarray(rng.normal(size=(model.cfg.hidden_size, 1)), jnp.float32)
  hidden = completion_hidden(model, packed.tokens, packed.attention_mask, packed.completion_len)
  logits, values = model.logits(hidden), head(hidden)
  ids, mask = packed.tokens[:, -packed.completion_len :], packed.model_mask
  adv, ret = ppo.gae(packed.rewards, values, mask, 0.9, 0.95)
  adv = ppo.whiten(adv, mask)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1)[..., 0]
  old = jnp.where(mask, logp + 0.05, 0.0)  # ratio 0.95: != 1, inside the clip range

  def total(lg, val):
    pl, _ = ppo.policy_loss(lg, ids, mask, adv, old_logps=old, loss_type="dapo")
    vl, _ = ppo.value_loss(val, values + 0.05, ret, mask, 0.2)
    return pl + 0.5 * vl.sum() / mask.sum()

  g_logits, g_values = jax.grad(total, argnums=(0, 1))(logits, values)
  per_pos = np.abs(np.asarray(g_logits)).sum(-1)
  assert (per_pos[~mask] == 0).all() and (np.asarray(g_values)[~mask] == 0).all()
  assert (per_pos[mask] > 0).all() and (np.asarray(g_values)[mask] != 0).all()
  for i, ep in enumerate(episodes):  # by the roles the episodes were built with, not by the mask
    roles = np.asarray(ep.roles[ep.prompt_len :])
    assert (per_pos[i, np.flatnonzero(roles == ENV)] == 0).all()
    assert (per_pos[i, np.flatnonzero(roles == MODEL)] > 0).all()


def test_fused_lm_head_policy_loss_matches_the_logits_path():
  """lm_head= (kernels.fused_linear_grpo_loss, no [B, T, V] logits) gives the logits path's loss and
  gradients with per-token advantages."""
  rng = np.random.default_rng(7)
  b, t, h, v = 2, 5, 8, 13
  hidden = jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(h, v)) * 0.5, jnp.float32)
  ids = rng.integers(0, v, size=(b, t)).astype(np.int32)
  mask = rng.random((b, t)) < 0.8
  adv = rng.normal(size=(b, t)).astype(np.float32)
  old = rng.normal(-2.5, 0.3, size=(b, t)).astype(np.float32)
  kw = dict(old_logps=old, loss_type="dapo", impl="xla")
  fused = jax.value_and_grad(
    lambda x, y: ppo.policy_loss(x, ids, mask, adv, lm_head=y, **kw)[0], argnums=(0, 1)
  )(hidden, w)
  plain = jax.value_and_grad(
    lambda x, y: ppo.policy_loss(jnp.einsum("bth,hv->btv", x, y), ids, mask, adv, **kw)[0],
    argnums=(0, 1),
  )(hidden, w)
  np.testing.assert_allclose(fused[0], plain[0], rtol=1e-5)
  for a, c in zip(fused[1], plain[1]):
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
