"""The sglang_jax rollout backend against our own engines (runs where sglang-jax is installed: `nox -s
sglang`, Python 3.12; skipped elsewhere), for a tied Qwen2 and an untied Qwen3: greedy outputs token for
token, in-memory weight re-sync (the untied head included), log-probs against a teacher-forced forward,
clear errors. The GRPO run with this backend is in test_sglang_jax_loop.py (one engine per process)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("sgl_jax")

from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, SamplingParams, make_engine
from rl.rollout.sampling import processed_logprobs

PROMPT_LENS = [5, 17, 3, 30, 9, 12]
EC = dict(max_seq_len=128, max_slots=8, page_size=8, steps_per_sync=4)


def _model(seed=0, **overrides):
  return scale_weights(
    init_model(preset("tiny-h128", dtype="float32", **overrides), seed=seed), 10.0
  )


MODELS = {
  "qwen2-tied": dict(),
  "qwen3-untied": dict(model_type="qwen3", qkv_bias=False, qk_norm=True, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
  return _model(**MODELS[request.param])


@pytest.fixture(scope="module")
def engine(model):  # one per model: pytest closes the first before it builds the second
  e = make_engine(model, EngineConfig(backend="sglang_jax", **EC), eos_ids=[])
  yield e
  e.close()


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [list(map(int, rng.integers(3, 300, size=n))) for n in PROMPT_LENS]


def _greedy(engine, prompts, **kw):
  return engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0, n=2, **kw))


def _assert_same_tokens(a, b, logprob_atol=1e-4):
  for x, y in zip(a.completions, b.completions, strict=True):
    assert (x.prompt_index, x.sample_index) == (y.prompt_index, y.sample_index)
    np.testing.assert_array_equal(x.token_ids, y.token_ids)
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=logprob_atol)
    assert x.finish_reason == y.finish_reason


def test_greedy_equals_paged_token_for_token(model, engine, prompts):
  paged = make_engine(model, EngineConfig(backend="paged", **EC), eos_ids=[])
  ref = _greedy(paged, prompts)
  assert len({tuple(c.token_ids) for c in ref.completions}) == len(prompts)  # varied outputs
  _assert_same_tokens(_greedy(engine, prompts), ref)
  # a stop token ends both the same way (kept as the last token, reason "eos")
  stop = int(ref.completions[0].token_ids[6])
  _assert_same_tokens(
    _greedy(engine, prompts, stop_token_ids=(stop,)),
    _greedy(paged, prompts, stop_token_ids=(stop,)),
  )


def test_long_completions_up_to_max_seq_len(model, engine, prompts):
  """Past sglang-jax's 50-token log-prob re-send (twice), one completion ending exactly at max_seq_len:
  the same tokens, log-probs and lengths as the paged engine, nothing clipped."""
  ps = [prompts[0], prompts[2]]
  sp = [
    SamplingParams(max_new_tokens=EC["max_seq_len"] - len(ps[0]), temperature=0.0),
    SamplingParams(max_new_tokens=110, temperature=0.0),
  ]
  paged = make_engine(model, EngineConfig(backend="paged", **EC), eos_ids=[])
  got = engine.generate(ps, sp)
  _assert_same_tokens(got, paged.generate(ps, sp))
  assert [len(c.token_ids) for c in got.completions] == [p.max_new_tokens for p in sp]


def test_resync_follows_new_weights(model, engine, prompts):
  before = _greedy(engine, prompts)
  saved = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  try:
    nnx.update(
      model, jax.tree.map(lambda x: x * 1.1, nnx.state(model, nnx.Param))
    )  # an "optimizer step"
    after = _greedy(engine, prompts)
    _assert_same_tokens(
      after, _greedy(make_engine(model, EngineConfig(backend="paged", **EC), eos_ids=[]), prompts)
    )
    assert any(
      not np.array_equal(a.token_ids, b.token_ids)
      for a, b in zip(before.completions, after.completions)
    )
    assert engine.sync_weights() == 0  # nothing changed since: nothing resent
  finally:
    nnx.update(model, saved)


def test_sampler_logprobs_equal_teacher_forced_forward(model, engine, prompts):
  sp = SamplingParams(max_new_tokens=12, temperature=0.7, n=2, seed=3)
  res = engine.generate(prompts[:2], sp)
  for c in res.completions:
    seq = np.concatenate([c.prompt_ids, c.token_ids])
    logits = model.logits(model(jnp.asarray(seq[None, :-1]))[0, len(c.prompt_ids) - 1 :])
    n = len(c.token_ids)
    logp = processed_logprobs(
      logits, jnp.full(n, sp.temperature), jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n)
    )
    expected = np.take_along_axis(np.asarray(logp), c.token_ids[:, None], axis=1)[:, 0]
    np.testing.assert_allclose(c.logprobs, expected, atol=2e-4, rtol=1e-4)
  assert len({tuple(c.token_ids) for c in res.completions}) > 1  # sampling, not greedy


def test_resync_of_the_head_alone(model, engine, prompts):
  """Only the output head changes (untied: lm_head; tied: the embedding it shares): a backend that
  left the head stale would keep the old outputs."""
  before = _greedy(engine, prompts)
  head = model.lm_head.kernel if not model.cfg.tie_word_embeddings else model.embed_tokens.embedding
  saved = jnp.copy(head[...])
  try:
    head.value = jax.random.normal(jax.random.key(7), saved.shape, saved.dtype) * 0.5
    after = _greedy(engine, prompts)
    _assert_same_tokens(
      after, _greedy(make_engine(model, EngineConfig(backend="paged", **EC), eos_ids=[]), prompts)
    )
    assert any(
      not np.array_equal(a.token_ids, b.token_ids)
      for a, b in zip(before.completions, after.completions)
    )
  finally:
    head.value = saved


@pytest.mark.parametrize(
  "overrides,match",
  [
    (dict(hidden_size=64, num_heads=4), "head_dim a multiple of 128"),
    (dict(num_kv_heads=1), "KV heads"),
  ],
)
def test_unsupported_models_are_clear_errors(overrides, match):  # checked before any engine starts
  with pytest.raises(ValueError, match=match):
    make_engine(
      init_model(preset("tiny-h128", **overrides)), EngineConfig(backend="sglang_jax", **EC)
    )


def test_sync_shares_buffers_where_layouts_allow(model, engine):
  """Same dtype, same device, no transpose, not a layer slice: the engine reads our buffers, no copy."""
  engine.sync_weights()
  ours, leaves = engine._params(), engine._runner.model_state_leaves
  pointer = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
  direct = [
    (ours[e.name], leaves[e.leaf]) for e in engine._plan if not e.transpose and e.layer is None
  ]
  assert direct and all(pointer(a) == pointer(b) for a, b in direct)
