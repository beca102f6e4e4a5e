"""Tunix's own agentic GRPO learner (``tunix.rl.agentic.agentic_grpo_learner``: async rollout
orchestrator, ModelAgent, a two-turn environment) on a tiny Qwen3 on CPU with the vanilla rollout:
trained a few steps with ``policy_loss_fn="grpo_kernels_fused"`` and, from the same seeds, with
tunix's ``"grpo"``; per-step metrics and final parameters compared.

The run exercises what the agentic learner adds over the plain GRPO one: completions that hold the
environment's tokens between two assistant turns (completion_mask 0 inside a row), the rollout's
log-probs as old log-probs with ``sampler_is="token"`` (the trainer's log-probs as old, truncated
importance weights in ``sampler_is_weights``), two GRPO iterations per batch (the ratio moves and
the clip acts), its own TrainExample (with ``policy_version``) and its loss wrapper (keyword
``algo_config``). Bugs this catches: a loss that handles any of these differently from
``grpo_loss_fn`` inside the learner, aux keys its logger reads (``entropy``, ``is_ratio/max``,
``sampler_is/weight_mean``, ...) missing, and a registration the agentic learner cannot find.

Determinism: the vanilla sampler seeds every call alike and ``max_concurrency=1`` runs one episode
at a time, so equal parameters give equal trajectories; the two generations of a prompt differ
because the environment answers each pair differently (``pair_index``), and the reward is the
length of the second answer (the environment's, summed by the agentic reward manager).
"""

import pytest

pytest.importorskip("tunix")

import numpy as np
from grain import python as grain
from tunix.generate import tokenizer_adapter
from tunix.rl.agentic import agentic_grpo_learner as agentic
from tunix.rl.agentic.agents import agent_types
from tunix.rl.agentic.environments import base_environment
from tunix.tests import test_common as tc

from kernels.integrations import tunix as grpo_tunix
from tests.integrations import tunix_learners as tl
from tests.integrations import tunix_problems as tp

STEPS = 3
WORDS = ["<pad>", "<s>", "</s>", "System:", "User:", "Assistant:", "input", "string", "hello"]
WORDS += ["world", "My", "name", "there", "again", "please", "try"]
PROMPTS = ["input string", "My name", "hello there"]
METRICS = ("loss", "kl", "entropy", "pg_loss", "pg_clipfrac", "is_ratio/max")
METRICS += ("sampler_is/weight_mean",)
RESPONSE = 12  # tokens per trajectory (both turns and the environment's reply)


class Parser:
  """A chat template of plain words ("User: ... Assistant:") the mock vocabulary can tokenize."""

  assistant_token = "Assistant:"

  def parse(self, messages, add_generation_prompt=False, is_first_msg=False):
    del is_first_msg
    text = " ".join(f"{m['role'].capitalize()}: {np.asarray(m['content']).item()}" for m in messages)  # fmt: skip
    return text + (" Assistant:" if add_generation_prompt else "")


class TwoTurnEnv(base_environment.BaseTaskEnv):
  """Turn 1: the environment answers with pair_index + 1 words; turn 2: reward = the length of
  the agent's second answer, episode over."""

  def __init__(self, single_example, *, reward_fn=None, **kwargs):
    super().__init__(task=single_example, reward_fn=reward_fn, max_steps=2, **kwargs)

  def _initial_observation(self):
    return self.task

  def _step_impl(self, action):
    text = getattr(action, "action", action)
    if self.step_count < 2:  # BaseTaskEnv counts the step before calling this
      words = ["try", "again", "please", "hello"][: 1 + self.extra_kwargs["pair_index"] % 4]
      return base_environment.EnvStepResult(" ".join(words), 0.0, False, {})
    return base_environment.EnvStepResult({}, float(len(text.split())), True, {})


def _train(policy_loss_fn: str):
  """(metrics, (params before, after)) of a fresh tiny Qwen3 trained STEPS steps."""
  actor, ref = tl.tiny_pair(len(WORDS))
  tokenizer = tokenizer_adapter.TokenizerAdapter(tc.MockVocab({w: i for i, w in enumerate(WORDS)}))
  cluster = tl.cluster(
    actor,
    steps=STEPS,
    reference=ref,
    tokenizer=tokenizer,
    top_k=None,  # sampled (seeded alike every call): short answers end with </s>
    temperature=1.0,
    max_tokens_to_generate=RESPONSE,
    max_prompt_length=16,
    return_logprobs=True,
  )
  config = agentic.GRPOConfig(
    policy_loss_fn=policy_loss_fn,
    num_generations=2,
    num_iterations=2,
    epsilon=0.02,  # small enough for SGD's moves to reach the clip
    beta=0.04,
    max_response_length=RESPONSE,
    max_concurrency=1,
    sampler_is="token",
    filter_statuses={agent_types.TrajectoryStatus.TIMEOUT},  # keep truncated trajectories
  )
  learner = agentic.GRPOLearner(
    rl_cluster=cluster, algo_config=config, chat_parser=Parser(), env_class=TwoTurnEnv
  )
  before = tl.params(actor)
  learner.train(grain.MapDataset.source(PROMPTS).batch(1).map(lambda x: {"prompts": x}))
  return tl.history(cluster, "actor", METRICS), (before, tl.params(actor))


def test_agentic_grpo_learner_matches_builtin_loss():
  grpo_tunix.register(fused_impl="chunked")  # the TPU / GPU default path, interpreted on CPU
  theirs = _train("grpo")
  ours = _train("grpo_kernels_fused")
  for name, e in theirs[0].items():
    assert len(ours[0][name]) == len(e) == STEPS, (name, ours[0][name], e)
    np.testing.assert_allclose(ours[0][name], e, rtol=tp.LOSS_RTOL, atol=1e-6, err_msg=name)
  assert max(theirs[0]["pg_clipfrac"]) > 0  # the clip acted
  assert min(theirs[0]["sampler_is/weight_mean"]) < 1  # the importance weights acted
  tl.assert_updates_match(ours[1], theirs[1], STEPS, "actor")
