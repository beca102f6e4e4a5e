"""Rollout engines: paged (continuous batching) against the dense reference sampler, sampler log-probs
against a teacher-forced forward, preemption, stop rules, live weights, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, SamplingParams, make_engine
from rl.rollout.paged_cache import PagePool
from rl.rollout.sampling import processed_logprobs
from rl.tokenizer import ByteTokenizer

PROMPT_LENS = [5, 17, 3, 30, 9, 12]  # ragged: some end on a page boundary of 8, most do not


@pytest.fixture(scope="module")
def model():
  return scale_weights(init_model(preset("tiny", dtype="float32"), seed=0), 10.0)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [list(map(int, rng.integers(3, 300, size=n))) for n in PROMPT_LENS]


def _engine(model, backend, eos_ids=(), **kw):
  cfg = dict(backend=backend, max_seq_len=64, max_slots=4, page_size=8, steps_per_sync=4)
  cfg.update(kw)
  return make_engine(model, EngineConfig(**cfg), eos_ids=eos_ids)


@pytest.fixture(scope="module")
def greedy(model, prompts):
  """Greedy rollouts, 2 samples per prompt (12 sequences through 4 slots), dense and paged."""
  sp = SamplingParams(max_new_tokens=20, temperature=0.0, n=2)
  return {b: _engine(model, b).generate(prompts, sp) for b in ("dense", "paged")}


def test_greedy_paged_equals_dense_token_for_token(greedy, prompts):
  dense, paged = greedy["dense"], greedy["paged"]
  assert [(c.prompt_index, c.sample_index) for c in paged.completions] == [
    (i, j) for i in range(6) for j in range(2)
  ]
  distinct = {tuple(c.token_ids) for c in dense.completions}
  assert len(distinct) == len(prompts)  # varied outputs (one per prompt: greedy samples agree)
  for d, p in zip(dense.completions, paged.completions):
    np.testing.assert_array_equal(p.token_ids, d.token_ids)
    np.testing.assert_allclose(p.logprobs, d.logprobs, atol=1e-4)
    assert p.finish_reason == d.finish_reason == "length" and len(p.token_ids) == 20
  # continuous batching: 12 sequences through 4 slots, no preemption at the default pool size
  assert paged.stats.completions == 12 and paged.stats.generated_tokens == 240
  assert paged.stats.preemptions == 0
  # the group's prefill is shared: each prompt is prefilled once, the dense sampler prefills every row
  assert paged.stats.prefill_tokens == sum(PROMPT_LENS)
  assert dense.stats.prefill_tokens == 2 * sum(PROMPT_LENS)


def test_page_exhaustion_preempts_and_recomputes_without_changing_outputs(model, prompts, greedy):
  pool = 1 + 64 // 8 + 4  # one sequence at max_seq_len and a little more: 4 slots cannot all run
  res = _engine(model, "paged", num_pages=pool).generate(
    prompts, SamplingParams(max_new_tokens=20, temperature=0.0, n=2)
  )
  assert res.stats.preemptions > 0
  assert sum(c.preemptions for c in res.completions) == res.stats.preemptions
  for a, b in zip(res.completions, greedy["paged"].completions):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.parametrize(
  "params",
  [dict(temperature=0.7), dict(temperature=1.3, top_k=20), dict(temperature=1.0, top_p=0.8)],
  ids=["temp", "top_k", "top_p"],
)
def test_sampler_logprobs_equal_teacher_forced_forward(model, prompts, params):
  sp = SamplingParams(max_new_tokens=12, n=2, seed=3, **params)
  res = _engine(model, "paged").generate(prompts[:3], sp)
  for c in res.completions:
    seq = np.concatenate([c.prompt_ids, c.token_ids])
    hidden = model(jnp.asarray(seq[None, :-1]))
    logits = model.logits(
      hidden[0, len(c.prompt_ids) - 1 :]
    )  # the positions that predict the completion
    n = len(c.token_ids)
    logp = processed_logprobs(
      logits, jnp.full(n, sp.temperature), jnp.full(n, sp.top_k, jnp.int32), jnp.full(n, sp.top_p)
    )
    expected = np.take_along_axis(np.asarray(logp), c.token_ids[:, None], axis=1)[:, 0]
    assert np.isfinite(expected).all()  # every drawn token was inside the top-k / nucleus
    np.testing.assert_allclose(c.logprobs, expected, atol=2e-4, rtol=1e-4)
  assert len({tuple(c.token_ids) for c in res.completions}) > 1  # sampling varies between samples


def test_sampling_depends_on_seed_not_on_batching(model, prompts):
  sp = SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=11)
  a = _engine(model, "paged", max_slots=3).generate(prompts[:4], sp)
  b = _engine(model, "paged", max_slots=8, steps_per_sync=3).generate(prompts[:4], sp)
  c = _engine(model, "dense", max_slots=12).generate(prompts[:4], sp)
  other = _engine(model, "paged", max_slots=8).generate(
    prompts[:4], SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=12)
  )
  for x, y, z in zip(a.completions, b.completions, c.completions):
    np.testing.assert_array_equal(x.token_ids, y.token_ids)
    np.testing.assert_array_equal(x.token_ids, z.token_ids)
  assert any(
    not np.array_equal(x.token_ids, o.token_ids) for x, o in zip(a.completions, other.completions)
  )


def test_eos_and_stop_strings_end_completions(model, prompts, greedy):
  ref = greedy["dense"].completions[0].token_ids
  eos = int(ref[5])
  first = int(np.argmax(ref == eos))
  for backend in ("dense", "paged"):
    res = _engine(model, backend, eos_ids=[eos]).generate(
      [prompts[0]], SamplingParams(max_new_tokens=20, temperature=0.0)
    )
    c = res.completions[0]
    assert c.finish_reason == "eos" and list(c.token_ids) == list(ref[: first + 1])
  tok = ByteTokenizer()
  target = tok.decode(ref[3:6])
  eng = make_engine(
    model, EngineConfig(backend="paged", max_seq_len=64, max_slots=4, page_size=8), tok, eos_ids=[]
  )
  c = eng.generate(
    [prompts[0]], SamplingParams(max_new_tokens=20, temperature=0.0, stop_strings=(target,))
  ).completions[0]
  assert c.finish_reason == "stop" and target in tok.decode(c.token_ids)
  assert target not in tok.decode(c.token_ids[:-1]) and len(c.token_ids) == len(c.logprobs) <= 6


def test_context_limit_finishes_with_length(model, prompts):
  res = _engine(model, "paged", max_seq_len=40).generate(
    [prompts[3]], SamplingParams(max_new_tokens=50, temperature=0.0)
  )
  c = res.completions[0]
  assert c.finish_reason == "length" and len(c.prompt_ids) + len(c.token_ids) == 40


def test_engine_reads_live_weights(prompts):
  model = scale_weights(init_model(preset("tiny", dtype="float32"), seed=1), 10.0)
  engine = _engine(model, "paged")
  sp = SamplingParams(max_new_tokens=8, temperature=0.0)
  before = engine.generate(prompts[:2], sp)
  nnx.update(
    model, jax.tree.map(lambda x: x * 1.1, nnx.state(model, nnx.Param))
  )  # an "optimizer step"
  after = engine.generate(prompts[:2], sp)
  fresh = _engine(model, "dense").generate(prompts[:2], sp)
  assert any(
    not np.array_equal(x.token_ids, y.token_ids)
    for x, y in zip(before.completions, after.completions)
  )
  for x, y in zip(after.completions, fresh.completions):
    np.testing.assert_array_equal(x.token_ids, y.token_ids)


def test_padded_batch_view(greedy):
  ids, mask, _lps = greedy["paged"].padded()
  assert ids.shape == (12, 20) and mask.all()
  with pytest.raises(ValueError, match="max_len"):
    greedy["paged"].padded(max_len=10)


def test_processed_logprobs_by_hand():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
  lp = np.exp(
    np.asarray(
      processed_logprobs(
        logits, jnp.array([1.0, 1.0, 1.0]), jnp.array([0, 2, 0]), jnp.array([1.0, 1.0, 0.6])
      )
    )
  )
  np.testing.assert_allclose(lp[0], [0.5, 0.3, 0.2], rtol=1e-6)
  np.testing.assert_allclose(lp[1], [0.625, 0.375, 0.0], rtol=1e-6)  # top-2 renormalised
  np.testing.assert_allclose(
    lp[2], [0.625, 0.375, 0.0], rtol=1e-6
  )  # 0.5 < 0.6: the 2nd token is needed


def test_page_pool_refcounts():
  pool = PagePool(5)
  a = pool.alloc(2)
  assert 0 not in a and pool.free == 2
  pool.share(a)
  pool.release(a)
  assert pool.free == 2
  pool.release(a)
  assert pool.free == 4
  with pytest.raises(RuntimeError):
    pool.release(a)


@pytest.mark.parametrize(
  "prompt,params,match",
  [
    ([], SamplingParams(), "empty"),
    (list(range(64)), SamplingParams(), "max_seq_len"),
    ([1, 2, 5000], SamplingParams(), "vocabulary"),
    ([1, 2], SamplingParams(n=9), "max_slots"),
    ([1, 2], SamplingParams(stop_strings=("x",)), "tokenizer"),
  ],
)
def test_bad_requests_are_clear_errors(model, prompt, params, match):
  with pytest.raises(ValueError, match=match):
    _engine(model, "paged").generate([prompt], params)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(backend="vllm"), "backend"),
    (dict(num_pages=5, max_seq_len=64, page_size=8), "cannot hold"),
    (dict(max_slots=0), "max_slots"),
  ],
)
def test_bad_engine_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig(**kwargs)


@pytest.mark.parametrize(
  "kwargs",
  [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-1), dict(n=0), dict(max_new_tokens=0)],
)
def test_bad_sampling_params(kwargs):
  with pytest.raises(ValueError):
    SamplingParams(**kwargs)


def test_sglang_backend_without_its_extra_is_a_clear_error():
  try:
    import sgl_jax  # noqa: F401

    pytest.skip("sglang-jax is installed here: tests/rl/test_sglang_jax.py covers the backend")
  except ImportError:
    pass
  with pytest.raises(ImportError, match=r"pip install -e '\.\[sglang\]'"):
    make_engine(init_model(preset("tiny-h128")), EngineConfig(backend="sglang_jax", max_seq_len=64))
