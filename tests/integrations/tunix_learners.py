"""Tunix's own learners on a tiny Qwen3 on CPU (vanilla rollout), trained a few steps: the shared
cluster builder and what the learner tests compare (per-step metrics, final parameters). Import
only where tunix is installed (the test modules importorskip it first)."""

from __future__ import annotations

import numpy as np
import optax
from flax import nnx
from jax.interpreters import pxla
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

from tests.integrations import tunix_problems as tp

LR = 1e-2  # SGD: a parameter's update is LR times its gradient, so the gradient target carries over


def cluster(
  actor, *, steps: int, reference=None, critic=None, tokenizer=None, **rollout
) -> rl_cluster_lib.RLCluster:
  """An RLCluster with every role on the default (one-CPU) mesh, SGD(LR) for actor and critic, the
  vanilla rollout (greedy: top_k=1, so equal parameters give equal completions), no evaluation."""
  mesh = pxla.thread_resources.env.physical_mesh
  roles = {"ACTOR", "ROLLOUT"} | ({"REFERENCE"} if reference is not None else set())
  roles |= {"CRITIC"} if critic is not None else set()
  rollout = dict(max_tokens_to_generate=6, max_prompt_length=8, kv_cache_size=64, temperature=0.9, top_k=1) | rollout  # fmt: skip
  config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={role: mesh for role in rl_cluster_lib.Role if role.name in roles},
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.sgd(LR),
      critic_optimizer=optax.sgd(LR) if critic is not None else None,
      eval_every_n_steps=100,
      max_steps=steps,
    ),
    rollout_config=base_rollout.RolloutConfig(**rollout),
  )
  return rl_cluster_lib.RLCluster(
    actor=actor,
    critic=critic,
    reference=reference,
    tokenizer=tokenizer if tokenizer is not None else tc.MockVocab(),
    cluster_config=config,
  )


def tiny_pair(vocab: int):
  """(actor, reference): the same tiny untied Qwen3 twice (seed 0)."""
  return tp.tiny_qwen3(False, vocab=vocab, seed=0), tp.tiny_qwen3(False, vocab=vocab, seed=0)


def params(model) -> dict:  # path -> np.ndarray, every nnx.Param
  return {k: np.array(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def history(cluster_: rl_cluster_lib.RLCluster, prefix: str, names) -> dict:
  """The per-step train history of each metric (``prefix``: "actor" or "critic")."""
  logger = cluster_.actor_trainer.metrics_logger
  return {n: [float(x) for x in logger.get_metric_history(prefix, n, "train")] for n in names}


def assert_updates_match(ours: tuple, theirs: tuple, steps: int, what: str) -> None:
  """(before, after) parameter dicts of two runs from the same start: every parameter's update
  (after - before) within steps * GRAD_RTOL of the largest update of tunix's run. Each SGD step's
  update is LR times a gradient that matches to GRAD_RTOL of the largest (the loss-level target),
  so after ``steps`` steps the updates agree to about steps times that (completions unchanged)."""
  (b0, a0), (b1, a1) = ours, theirs
  assert b0.keys() == b1.keys() == a0.keys() == a1.keys()
  for k in b0:
    np.testing.assert_array_equal(b0[k], b1[k], err_msg=f"{what}: runs start apart at {k}")
  top = max(float(np.max(np.abs(a1[k] - b1[k]))) for k in b1)
  assert top > 0, f"{what}: tunix's run moved no parameter"
  worst = max(float(np.max(np.abs((a0[k] - b0[k]) - (a1[k] - b1[k])))) for k in b1)
  assert worst <= steps * tp.GRAD_RTOL * top, (what, worst / top)
