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
import optax
from flax import nnx
from grain import python as grain
from jax.interpreters import pxla
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

from kernels.integrations import tunix as grpo_tunix
from tests.integrations import tunix_problems as tp

STEPS = 3
PROMPTS = ["input string", "hello world", "My name", "hello there"] * 4


def _reward(completions, **kwargs):  # distinct rewards within each group: nonzero advantages
  del kwargs
  return np.arange(len(completions), dtype=np.float32)


def _train(policy_loss_fn: str) -> tuple[list[float], list[float]]:
  """Per-step (loss, kl) of a fresh tiny Qwen3 trained STEPS steps (same seeds every call)."""
  vocab = tc.MockVocab()
  model = tp.tiny_qwen3(False, vocab=vocab.GetPieceSize(), seed=0)
  ref = tp.tiny_qwen3(False, vocab=vocab.GetPieceSize(), seed=0)
  mesh = pxla.thread_resources.env.physical_mesh
  cluster = rl_cluster_lib.RLCluster(
    actor=model,
    reference=ref,
    tokenizer=vocab,
    cluster_config=rl_cluster_lib.ClusterConfig(
      role_to_mesh={
        role: mesh for role in rl_cluster_lib.Role if role.name in ("ACTOR", "REFERENCE", "ROLLOUT")
      },
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=STEPS
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=6, max_prompt_length=8, kv_cache_size=64, temperature=0.9, top_k=1
      ),
    ),
  )
  config = grpo_learner.GRPOConfig(num_generations=2, beta=0.04, policy_loss_fn=policy_loss_fn)
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=_reward, algo_config=config)
  data = grain.MapDataset.source(PROMPTS).batch(2).map(lambda x: {"prompts": x, "answer": x})
  before = nnx.state(model, nnx.Param)
  before = {k: np.array(v) for k, v in nnx.to_flat_state(before)}
  learner.train(data)
  after = {k: np.array(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert any(not np.array_equal(before[k], after[k]) for k in before), "no parameter moved"
  logger = cluster.actor_trainer.metrics_logger
  hist = lambda name: [float(x) for x in logger.get_metric_history("actor", name, "train")]
  return hist("loss"), hist("kl")


def test_learner_steps_match_builtin_loss():
  grpo_tunix.register(fused_impl="chunked")  # the TPU / GPU default path, interpreted on CPU
  theirs = _train("grpo")
  ours = _train("grpo_kernels_fused")
  assert len(ours[0]) == len(theirs[0]) == STEPS
  np.testing.assert_allclose(ours[0], theirs[0], rtol=tp.LOSS_RTOL, atol=1e-7)
  np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-7)
  assert max(abs(x) for x in theirs[0]) > 0  # a loss that moves the policy
