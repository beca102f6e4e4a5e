"""A real tunix GRPOLearner run on CPU: a tiny Qwen3 trained a few steps with
``policy_loss_fn="grpo_kernels_fused"`` and, from the same seeds, with tunix's built-in "grpo" loss.

Bugs this catches: a loss that matches grpo_loss_fn in isolation but not inside the learner (the
learner's jit, nnx.value_and_grad over the model, its micro-batching and metric logging of ``kl`` /
``pg_clipfrac``), a registration the learner cannot find, aux keys the learner's logger rejects, and
a hidden-state capture (nnx sow / pop) that breaks under the trainer's transforms.
"""

import pytest

pytest.importorskip("tunix")

import numpy as np
from grain import python as grain
from tunix.rl.grpo import grpo_learner
from tunix.tests import test_common as tc

from kernels.integrations import tunix as grpo_tunix
from tests.integrations import tunix_learners as tl
from tests.integrations import tunix_problems as tp

STEPS = 3
PROMPTS = ["input string", "hello world", "My name", "hello there"] * 4


def _reward(completions, **kwargs):  # distinct rewards within each group: nonzero advantages
  del kwargs
  return np.arange(len(completions), dtype=np.float32)


def _train(policy_loss_fn: str):
  """(per-step loss and kl, (params before, after)) of a fresh tiny Qwen3 trained STEPS steps
  (same seeds every call)."""
  vocab = tc.MockVocab()
  model, ref = tl.tiny_pair(vocab.GetPieceSize())
  cluster = tl.cluster(model, steps=STEPS, reference=ref, tokenizer=vocab)
  config = grpo_learner.GRPOConfig(num_generations=2, beta=0.04, policy_loss_fn=policy_loss_fn)
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=_reward, algo_config=config)
  data = grain.MapDataset.source(PROMPTS).batch(2).map(lambda x: {"prompts": x, "answer": x})
  before = tl.params(model)
  learner.train(data)
  return tl.history(cluster, "actor", ("loss", "kl")), (before, tl.params(model))


def test_learner_steps_match_builtin_loss():
  grpo_tunix.register(fused_impl="chunked")  # the TPU / GPU default path, interpreted on CPU
  theirs = _train("grpo")
  ours = _train("grpo_kernels_fused")
  for name, e in theirs[0].items():
    assert len(ours[0][name]) == len(e) == STEPS, name
  np.testing.assert_allclose(ours[0]["loss"], theirs[0]["loss"], rtol=tp.LOSS_RTOL, atol=1e-7)
  np.testing.assert_allclose(ours[0]["kl"], theirs[0]["kl"], rtol=1e-4, atol=1e-7)
  assert max(abs(x) for x in theirs[0]["loss"]) > 0  # a loss that moves the policy
  tl.assert_updates_match(ours[1], theirs[1], STEPS, "actor")
