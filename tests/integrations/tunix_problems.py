"""Tiny real tunix models and GRPO train examples for the tunix integration tests (import only
where tunix is installed: the test modules importorskip it first)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import common
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner

PAD, EOS = 0, 2
# The targets (f32, CPU): loss relative error and gradients relative to the largest one.
LOSS_RTOL, GRAD_RTOL = 1e-4, 1e-3


def tiny_qwen3(tied: bool, vocab: int = 97, seed: int = 0, dtype=jnp.float32) -> qwen3.Qwen3:
  cfg = qwen3.ModelConfig(
    num_layers=2,
    vocab_size=vocab,
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    rope_theta=10_000,
    norm_eps=1e-6,
    use_tied_embedding=tied,
    dtype=dtype,
    param_dtype=dtype,
  )
  return qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))


def grpo_config(**options) -> grpo_learner.GRPOConfig:
  """A GRPOConfig; epsilon_high / epsilon_c / temperature are attributes tunix reads with getattr
  (the learner sets temperature from the rollout config)."""
  extra = {k: options.pop(k) for k in ("epsilon_high", "epsilon_c") if k in options}
  extra["temperature"] = options.pop("temperature", 1.0)  # grpo_loss_fn reads it unconditionally
  cfg = grpo_learner.GRPOConfig(num_generations=2, **options)
  for k, v in extra.items():
    setattr(cfg, k, v)
  return cfg


@dataclasses.dataclass(slots=True, kw_only=True)
class KLPPOConfig(ppo_learner.PPOConfig):
  """PPOConfig with the ``kl_coef`` that ppo_policy_loss_fn reads with getattr (0.1.7's PPOConfig
  has no such field, and its slots refuse a new attribute)."""

  kl_coef: float = 0.0


def ppo_example(ex) -> ppo_learner.TrainExample:
  """The PPO learner's TrainExample with ``ex``'s fields (per-token advantages expected)."""
  fields = {f.name: getattr(ex, f.name) for f in dataclasses.fields(ex)}
  return ppo_learner.TrainExample(**fields)


def true_logps(model, example, temperature=1.0):  # -> [B, T] f32 (the model's own log-probs)
  g, state = nnx.split(model)
  return common.compute_per_token_logps(
    g,
    state,
    prompt_tokens=example.prompt_ids,
    completion_tokens=example.completion_ids,
    pad_id=PAD,
    eos_id=EOS,
    segment_ids=example.segment_ids,
    segment_positions=example.segment_positions,
    temperature=temperature,
  )


def example(model, *, seed=0, b=4, p=5, t=7, vocab=97, old="near", ref=True, weights=False,
            token_adv=False, packed=False, old_shift=None, temperature=1.0):  # fmt: skip
  """A train example with ragged completions (one row empty), left-padded prompts, advantages of
  both signs. old: "near" (log-probs 0.3 nats off the model's), None (on-policy), or near plus
  ``old_shift`` [B] nats per row (to reach the clamps)."""
  rng = np.random.default_rng(seed)
  if packed:
    return _packed(model, rng, b, p + t, vocab, ref, weights, temperature)
  prompt = rng.integers(3, vocab, (b, p))
  prompt[:, :2] = PAD
  lengths = np.array([t, 3, 0, 5, 1, 6][:b])
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
  comp = np.where(mask, rng.integers(3, vocab, (b, t)), PAD)
  adv = rng.normal(size=(b, t) if token_adv else b).astype(np.float32)
  adv[0] = np.abs(adv[0]) + 0.5  # both signs: row 0 positive, row 1 negative (the dual clip)
  adv[1] = -np.abs(adv[1]) - 0.5
  ex = grpo_learner.TrainExample(
    prompt_ids=jnp.asarray(prompt),
    prompt_mask=jnp.asarray(prompt != PAD),
    completion_ids=jnp.asarray(comp),
    completion_mask=jnp.asarray(mask),
    advantages=jnp.asarray(adv),
    ref_per_token_logps=None,
    old_per_token_logps=None,
  )
  return _with_logps(model, ex, rng, old, ref, weights, old_shift, temperature)


def _with_logps(model, ex, rng, old, ref, weights, old_shift, temperature):
  logp = np.asarray(true_logps(model, ex, temperature))
  noise = lambda: rng.normal(scale=0.3, size=logp.shape).astype(np.float32)
  fields = {}
  if old is not None:
    o = logp + noise()
    if old_shift is not None:
      o = o - np.asarray(old_shift, np.float32)[:, None]
    fields["old_per_token_logps"] = jnp.asarray(o)
  if ref:
    fields["ref_per_token_logps"] = jnp.asarray(logp + noise())
  if weights:
    fields["sampler_is_weights"] = jnp.asarray(rng.uniform(0.0, 2.0, logp.shape), jnp.float32)
  return ex.replace(**fields)


def _packed(model, rng, b, length, vocab, ref, weights, temperature):
  """Two documents per row ([prompt 3 | completion] each) and tail padding; prompt_ids is [B, 0]."""
  seg = np.zeros((b, length), np.int32)
  pos = np.zeros((b, length), np.int32)
  mask = np.zeros((b, length), np.int32)
  cut = length // 2
  for i in range(b):
    end = length - i  # row i has i padding tokens
    for doc, (lo, hi) in enumerate(((0, cut), (cut, end))):
      seg[i, lo:hi] = doc + 1
      pos[i, lo:hi] = np.arange(hi - lo)
      mask[i, lo + 3 : hi] = 1  # the first 3 tokens of a document are its prompt
  tokens = np.where(seg > 0, rng.integers(3, vocab, (b, length)), PAD)
  ex = grpo_learner.TrainExample(
    prompt_ids=jnp.zeros((b, 0), jnp.int32),
    prompt_mask=jnp.zeros((b, 0), bool),
    completion_ids=jnp.asarray(tokens),
    completion_mask=jnp.asarray(mask),
    advantages=jnp.asarray(rng.normal(size=(b, length)), jnp.float32),
    ref_per_token_logps=None,
    old_per_token_logps=None,
    segment_ids=jnp.asarray(seg),
    segment_positions=jnp.asarray(pos),
  )
  return _with_logps(model, ex, rng, "near", ref, weights, None, temperature)


def loss_and_grads(loss_fn, model, ex, cfg):
  """(loss, aux, grads) of ``loss_fn(model, ex, cfg, PAD, EOS)`` w.r.t. every nnx.Param, jitted."""
  return losses_and_grads([loss_fn], model, ex, cfg)[0]


def losses_and_grads(loss_fns, model, ex, cfg) -> list:
  """[(loss, aux, grads)] of each loss fn, all in one jitted program (one compile: the tests'
  time on CPU is mostly XLA compiles)."""
  graph, state = nnx.split(model)

  def all_of(state):
    out = []
    for fn in loss_fns:
      f = lambda s, fn=fn: fn(nnx.merge(graph, s), ex, cfg, PAD, EOS)
      (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(state)
      out.append((loss, aux, grads))
    return out

  return jax.jit(all_of)(state)


def assert_all_match(reference_fn, ours: dict, model, ex, cfg, msg: str) -> None:
  """Each of ``ours`` (name -> loss fn) matches ``reference_fn`` (:func:`assert_matches`),
  computed in one program."""
  theirs, *mine = losses_and_grads([reference_fn, *ours.values()], model, ex, cfg)
  for name, result in zip(ours, mine):
    assert_matches(result, theirs, f"{msg} {name}")


def loss_and_aux(loss_fn, model, ex, cfg):
  """(loss, aux) of ``loss_fn(model, ex, cfg, PAD, EOS)``, jitted, no gradient (cheaper to compile)."""
  graph, state = nnx.split(model)
  return jax.jit(lambda state: loss_fn(nnx.merge(graph, state), ex, cfg, PAD, EOS))(state)


def assert_matches(ours, theirs, msg: str):
  """Loss within LOSS_RTOL, every parameter gradient within GRAD_RTOL of the largest, every aux key
  of tunix's within 1e-5 (relative to max(1, |value|))."""
  loss, aux, grads = ours
  e_loss, e_aux, e_grads = theirs
  assert abs(float(loss) - float(e_loss)) <= LOSS_RTOL * abs(float(e_loss)), (msg, loss, e_loss)
  leaves, e_leaves = jax.tree.leaves(grads), jax.tree.leaves(e_grads)
  assert len(leaves) == len(e_leaves) > 0
  top = max(float(jnp.max(jnp.abs(g))) for g in e_leaves)
  assert top > 0, msg
  worst = max(float(jnp.max(jnp.abs(a - e))) for a, e in zip(leaves, e_leaves))
  assert worst <= GRAD_RTOL * top, (msg, worst / top)
  assert set(e_aux) <= set(aux), (msg, set(e_aux) - set(aux))
  for key, value in e_aux.items():
    a, e = float(aux[key]), float(value)
    assert abs(a - e) <= 1e-5 * max(1.0, abs(e)), (msg, key, a, e)
