"""The fused tunix losses' compiled gradients at Qwen's vocabulary (V = 151936) hold no [B, T, V]
array — and tunix's own loss, compiled the same way, does (so the check can fail).

Bugs this catches: the hidden-state path still materialising the logits (the model's unused
``lm_head`` output kept alive, e.g. returned or sown), an impl falling back to the XLA reference,
the gradient of the tied embedding's transpose building a [B, T, V] intermediate, and PPO's entropy
bonus computed (or differentiated) on the whole [B, T, V] logits instead of chunk by chunk.
"""

import math
import re

import pytest

pytest.importorskip("tunix")

import jax
from flax import nnx
from tunix.rl import algo_core

from kernels.integrations import tunix as grpo_tunix
from tests.integrations import tunix_problems as tp

VOCAB = 151936
B, P, T = 2, 8, 1536  # 3072 scored tokens: more than the chunked path's 1024-token chunk


def _abstract_example(ppo: bool = False):
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  example = tp.ppo_learner.TrainExample if ppo else tp.grpo_learner.TrainExample
  return example(
    prompt_ids=s((B, P), "int32"),
    prompt_mask=s((B, P), "bool"),
    completion_ids=s((B, T), "int32"),
    completion_mask=s((B, T), "int32"),
    advantages=s((B, T) if ppo else (B,), "float32"),
    ref_per_token_logps=s((B, T), "float32"),
    old_per_token_logps=s((B, T), "float32"),
  )


def _largest_array(loss_fn, tied: bool, ppo: bool = False) -> int:
  """Elements of the largest array in the compiled gradient of loss_fn (abstract model: nothing
  is allocated)."""
  model = nnx.eval_shape(lambda: tp.tiny_qwen3(tied, vocab=VOCAB))
  graph, state = nnx.split(model)
  if ppo:  # every option on: the entropy bonus (its chunks) and the k1 KL
    cfg = tp.KLPPOConfig(entropy_coef=0.01, kl_coef=0.05, epsilon_c=3.0)
  else:
    cfg = tp.grpo_config(beta=0.04)

  def f(state, ex):
    return loss_fn(nnx.merge(graph, state), ex, cfg, tp.PAD, tp.EOS)

  grad = jax.grad(f, has_aux=True)
  hlo = jax.jit(grad).trace(state, _abstract_example(ppo)).lower().compile().as_text()
  dims = re.findall(r"\b(?:f32|bf16|f16|s32|pred)\[([\d,]+)\]", hlo)
  return max(math.prod(int(d) for d in s.split(",")) for s in dims)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_gradient_holds_no_logits(tied):
  fused = lambda *a: grpo_tunix.policy_loss(*a, fused=True, impl="chunked")
  ours = _largest_array(fused, tied)
  assert ours < B * T * VOCAB // 2, f"an array of {ours} elements: the [B, T, V] logits are back"
  if not tied:  # the contrast, once: tunix's loss holds the [B, T + P, V] logits
    assert _largest_array(algo_core.grpo_loss_fn, tied) >= B * T * VOCAB


def test_fused_ppo_gradient_holds_no_logits():
  """ppo_kernels_fused with the entropy bonus: the entropy's [chunk, V] logits (1024 tokens here),
  never the [B, T, V] ones."""
  fused = lambda *a: grpo_tunix.ppo_policy_loss(*a, fused=True, impl="chunked")
  ours = _largest_array(fused, False, ppo=True)
  assert ours < B * T * VOCAB // 2, f"an array of {ours} elements: the [B, T, V] logits are back"
