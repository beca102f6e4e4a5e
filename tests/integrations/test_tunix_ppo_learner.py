"""Tunix's own PPOLearner (actor + critic, GAE advantages, KL reward penalty) on a tiny Qwen3 on CPU
with the vanilla rollout: trained a few steps with ``policy_loss_fn="ppo_kernels_fused"`` and, from
the same seeds, with tunix's built-in ``"ppo"`` loss; per-step metrics and final parameters (actor
and critic) compared.

Bugs this catches: a PPO loss that matches ``ppo_policy_loss_fn`` in isolation but not inside the
learner (its jit, ``nnx.value_and_grad`` over the model, PPO epochs over one rollout batch —
``num_iterations=2`` makes the ratio move, so the clip acts), a registration the learner cannot find
(``LookupError``), aux keys the learner's logger misses (``pg_clipfrac_lower`` with ``epsilon_c``,
``loss/entropy`` with ``entropy_coef``), an entropy bonus or k1 KL term lost between config and
loss, and a policy gradient that drifts the critic's training (it sees the actor's rollouts).
"""

import pytest

pytest.importorskip("tunix")

import numpy as np
from grain import python as grain
from tunix.rl import utils as rl_utils
from tunix.rl.ppo import ppo_learner
from tunix.tests import test_common as tc

from kernels.integrations import tunix as grpo_tunix
from tests.integrations import tunix_learners as tl
from tests.integrations import tunix_problems as tp

STEPS = 3
PROMPTS = ["input string", "hello world", "My name", "hello there"] * 3
ACTOR_METRICS = ("loss", "pg_clipfrac", "pg_clipfrac_lower", "loss/entropy")
CRITIC_METRICS = ("loss", "vpred_mean", "vf_clipfrac")


def _reward(completions, **kwargs):  # distinct per row: GAE advantages of both signs
  del kwargs
  return np.arange(len(completions), dtype=np.float32)


def _train(policy_loss_fn: str):
  """(actor metrics, critic metrics, actor (before, after), critic (before, after)) of a fresh
  tiny actor + critic trained STEPS steps (same seeds every call)."""
  vocab = tc.MockVocab()
  actor, ref = tl.tiny_pair(vocab.GetPieceSize())
  critic = rl_utils.create_critic_model(actor, seed=1)  # a copy of the actor with a [D, 1] head
  cluster = tl.cluster(actor, steps=STEPS, reference=ref, critic=critic, tokenizer=vocab)
  config = tp.KLPPOConfig(
    policy_loss_fn=policy_loss_fn,
    num_iterations=2,  # the second epoch on a batch has ratio != 1
    epsilon=0.02,  # small enough for SGD's moves to reach the clip
    epsilon_c=1.03,
    entropy_coef=0.01,
    kl_coef=0.05,
  )
  learner = ppo_learner.PPOLearner(rl_cluster=cluster, ppo_config=config, reward_fns=_reward)
  before = tl.params(actor), tl.params(critic)
  data = grain.MapDataset.source(PROMPTS).batch(2).map(lambda x: {"prompts": x})
  learner.train(data)
  return (
    tl.history(cluster, "actor", ACTOR_METRICS),
    tl.history(cluster, "critic", CRITIC_METRICS),
    (before[0], tl.params(actor)),
    (before[1], tl.params(critic)),
  )


def test_ppo_learner_matches_builtin_loss():
  grpo_tunix.register(fused_impl="chunked")  # the TPU / GPU default path, interpreted on CPU
  theirs = _train("ppo")
  ours = _train("ppo_kernels_fused")
  for prefix, a, e in (("actor", ours[0], theirs[0]), ("critic", ours[1], theirs[1])):
    for name in e:
      assert len(a[name]) == len(e[name]) >= STEPS, (prefix, name, a[name], e[name])
      np.testing.assert_allclose(
        a[name], e[name], rtol=tp.LOSS_RTOL, atol=1e-6, err_msg=f"{prefix}/{name}"
      )
  assert max(theirs[0]["pg_clipfrac"]) > 0  # the clip acted in tunix's run (the dual clip's
  # flags are logged, but SGD rarely raises a negative-advantage token's ratio past epsilon_c here:
  # test_tunix_ppo_loss covers its values)
  tl.assert_updates_match(ours[2], theirs[2], 2 * STEPS, "actor")  # two PPO epochs per step
  tl.assert_updates_match(ours[3], theirs[3], 2 * STEPS, "critic")
