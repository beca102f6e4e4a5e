"""Rollout engines: paged (continuous batching) against the dense reference sampler, sampler log-probs
against a teacher-forced forward, preemption, stop rules, live weights, and bad input."""

import concurrent.futures
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.grpo_loss.reference import token_logps_and_entropy
from rl.config import GRPOConfig, SamplingSection
from rl.data.tokenizer import ByteTokenizer
from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, SamplingParams, make_engine
from rl.rollout.paged_cache import PagePool
from rl.rollout.sampling import processed_logprobs

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


def test_chunks_narrowed_to_the_live_pages_and_running_rows_match_dense(model, prompts, greedy):
  """Pages of 2 tokens (32 per sequence): decode chunks whose page table is only as wide as the
  longest running sequence needs (16 of 32 pages once the 30-token prompt's samples finish) and whose
  batch holds only the running sequences (12 slots, 8 rows once 8 or fewer run) must give dense's
  tokens. Catches a table cut short of a sequence's last page (its newest keys dropped), and a
  sequence's results read back from another row after packing."""
  lens = [20, 3, 11, 4, 7, 15]
  params = [SamplingParams(max_new_tokens=m, temperature=0.0, n=2) for m in lens]
  paged = _engine(model, "paged", page_size=2, max_slots=12).generate(prompts, params)
  dense = _engine(model, "dense").generate(prompts, params)
  for d, p in zip(dense.completions, paged.completions):
    np.testing.assert_array_equal(p.token_ids, d.token_ids)
    np.testing.assert_allclose(p.logprobs, d.logprobs, atol=1e-4)
  assert [len(c.token_ids) for c in paged.completions] == [m for m in lens for _ in range(2)]


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
  [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=20),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, top_k=20, top_p=0.9),
    dict(temperature=0.8, min_p=0.1),
  ],
  ids=["temp", "top_k", "top_p", "top_k+top_p", "min_p"],
)
@pytest.mark.parametrize("backend", ["paged", "dense"])
def test_sampler_logprobs_equal_teacher_forced_forward(model, prompts, params, backend):
  """Each engine's log-prob and support gap of every token against a teacher-forced forward: the
  processed log-prob, and the trainer's truncated log-prob (kernels.support, the gap scoring the
  teacher-forced logits) within 1e-5 in f32. Catches an engine reporting full-softmax log-probs, a
  gap that drops or adds tokens to the set it drew from (a top-k / top-p that is not a threshold set,
  a gap formed before the temperature), a gap not reported by one backend, and a gap on an unfiltered
  row (it must be -inf there)."""
  sp = SamplingParams(max_new_tokens=12, n=2, seed=3, **params)
  res = _engine(model, backend).generate(prompts[:3], sp)
  filtered = sp.top_k > 0 or sp.top_p < 1 or sp.min_p > 0
  for c in res.completions:
    seq = np.concatenate([c.prompt_ids, c.token_ids])
    hidden = model(jnp.asarray(seq[None, :-1]))
    logits = model.logits(
      hidden[0, len(c.prompt_ids) - 1 :]
    )  # the positions that predict the completion
    n = len(c.token_ids)
    full = lambda x, n=n: jnp.full(n, x)
    logp = processed_logprobs(
      logits, full(sp.temperature), full(sp.top_k).astype(jnp.int32), full(sp.top_p), full(sp.min_p)
    )
    expected = np.take_along_axis(np.asarray(logp), c.token_ids[:, None], axis=1)[:, 0]
    assert np.isfinite(expected).all()  # every drawn token was inside its kept set
    np.testing.assert_allclose(c.logprobs, expected, atol=2e-4, rtol=1e-4)
    assert c.support_gaps is not None and c.support_gaps.shape == (n,)
    if not filtered:
      assert (c.support_gaps == -np.inf).all()
      continue
    assert np.isfinite(c.support_gaps).all() and (c.support_gaps <= 0).all()
    trainer, _ = token_logps_and_entropy(
      logits, jnp.asarray(c.token_ids), sp.temperature, jnp.asarray(c.support_gaps)
    )
    np.testing.assert_allclose(np.asarray(trainer), expected, atol=1e-5, rtol=0)
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


def test_engines_hand_the_steps_weights_in_the_compute_dtype():
  """f32 master weights, bf16 compute: the decode steps get every float weight already in bf16 (one
  cast per generate, not one per step: the per-step cast was ~30 % of CPU decode time and a read of
  f32 weights on every backend), and the cast changes no logit (the model casts at use anyway)."""
  model = init_model(preset("tiny"), seed=0)
  assert model.cfg.param_dtype == "float32" and model.cfg.dtype == "bfloat16"
  graphdef, state = _engine(model, "paged")._rollout_graph()
  floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
  tokens = jnp.asarray([[5, 9, 2, 7]], jnp.int32)
  held = nnx.merge(graphdef, state)
  np.testing.assert_array_equal(
    np.asarray(held.logits(held(tokens))), np.asarray(model.logits(model(tokens)))
  )


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
        logits,
        jnp.array([1.0, 1.0, 1.0]),
        jnp.array([0, 2, 0]),
        jnp.array([1.0, 1.0, 0.6]),
        jnp.zeros(3),
      )
    )
  )
  np.testing.assert_allclose(lp[0], [0.5, 0.3, 0.2], rtol=1e-6)
  np.testing.assert_allclose(lp[1], [0.625, 0.375, 0.0], rtol=1e-6)  # top-2 renormalised
  np.testing.assert_allclose(
    lp[2], [0.625, 0.375, 0.0], rtol=1e-6
  )  # 0.5 < 0.6: the 2nd token is needed


def test_page_pool_refcounts():
  pool = PagePool(5, page_size=4)
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
    (
      dict(attn_impl="bogus"),
      r"attn_impl must be one of \('auto', 'pallas', 'xla', 'mosaic_gpu'\)",
    ),
    (dict(cache_dtype="float77"), "cache_dtype"),
  ],
)
def test_bad_engine_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig(**kwargs)


@pytest.mark.parametrize(
  "kwargs,exc,match",
  [
    (dict(seed=-1), ValueError, r"seed must be in \[0, 4294967295\]"),  # was a uint32 OverflowError
    (dict(seed=2**32), ValueError, r"seed must be in \[0, 4294967295\]"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(temperature=float("nan")), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=-1), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite and >= 0"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=2.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p=float("nan")), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p="0.1"), TypeError, "min_p must be a number"),
    (dict(top_k=-3), ValueError, "top_k must be >= 0"),
    (dict(top_k=2.5), TypeError, "top_k must be an int"),
    (dict(n=0), ValueError, "n must be >= 1"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=-2), ValueError, "max_new_tokens must be >= 1"),
    (dict(stop_token_ids=(3, -1)), ValueError, "stop_token_ids"),
  ],
)
def test_bad_sampling_params(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    SamplingParams(**kwargs)


def test_seed_range_ends_are_accepted_and_differ(model, prompts):
  """The range the error names is the one the sampler takes: both ends run, and draw differently."""
  eng = _engine(model, "paged")
  lo, hi = (
    eng.generate(prompts[:2], SamplingParams(max_new_tokens=6, n=2, seed=s)) for s in (0, 2**32 - 1)
  )
  assert any(
    not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(lo.completions, hi.completions)
  )


def test_generate_rejects_params_that_are_not_sampling_params(model, prompts):
  with pytest.raises(TypeError, match="SamplingParams"):
    _engine(model, "paged").generate(prompts[:1], [dict(temperature=1.0)])


def test_sglang_backend_without_its_extra_is_a_clear_error():
  try:
    import sgl_jax  # noqa: F401

    pytest.skip(
      "sglang-jax is installed here: tests/rl/rollout/test_sglang_jax.py covers the backend"
    )
  except ImportError:
    pass
  with pytest.raises(ImportError, match=r"pip install -e '\.\[sglang\]'"):
    make_engine(init_model(preset("tiny-h128")), EngineConfig(backend="sglang_jax", max_seq_len=64))


# ------------------------------------------------------------------- finishing during prefill (#16)
def _finish_at_prefill_cases(greedy, prompts):
  first_tokens = tuple(sorted({int(c.token_ids[0]) for c in greedy["dense"].completions}))
  long = [list(map(int, np.random.default_rng(1).integers(3, 300, size=63))) for _ in range(5)]
  return {
    # every sequence of every round finishes on its first token: 12 samples through 4 slots
    "max_new_tokens=1": (prompts, SamplingParams(max_new_tokens=1, n=2, seed=4), ()),
    "first_token_eos": (
      prompts,
      SamplingParams(max_new_tokens=20, temperature=0.0, n=2),
      first_tokens,
    ),
    "prompt_max_seq_len-1": (long, SamplingParams(max_new_tokens=20, n=2, seed=5), ()),
    # rounds where some sequences finish at prefill and others decode beside them
    "mixed": (
      prompts,
      [SamplingParams(max_new_tokens=1 + 7 * (i % 2), n=2, seed=6) for i in range(len(prompts))],
      (),
    ),
  }


@pytest.mark.parametrize(
  "case", ["max_new_tokens=1", "first_token_eos", "prompt_max_seq_len-1", "mixed"]
)
def test_sequences_that_finish_during_prefill_match_dense(model, prompts, greedy, case):
  batch, params, eos = _finish_at_prefill_cases(greedy, prompts)[case]
  dense, paged = (
    _engine(model, b, eos_ids=eos).generate(batch, params) for b in ("dense", "paged")
  )
  assert len(paged.completions) == len(dense.completions) == 2 * len(batch)
  for d, p in zip(dense.completions, paged.completions):
    assert (p.prompt_index, p.sample_index, p.finish_reason) == (
      d.prompt_index,
      d.sample_index,
      d.finish_reason,
    )
    np.testing.assert_array_equal(p.token_ids, d.token_ids)
    np.testing.assert_allclose(p.logprobs, d.logprobs, atol=1e-4)
  lens = [len(c.token_ids) for c in paged.completions]
  if case == "mixed":
    assert set(lens) == {1, 8}
  else:
    assert lens == [1] * len(lens)  # the case really finishes every sequence at its first token
    reason = "eos" if case == "first_token_eos" else "length"
    assert {c.finish_reason for c in paged.completions} == {reason}


# ------------------------------------------------------------------- groups vs the page pool (#16)
def test_group_that_can_never_fit_the_pool_is_rejected_up_front(model):
  """12 pages (11 usable) of 8 tokens: a 60-token prompt takes 8 pages, each further sample one more."""
  eng = _engine(model, "paged", num_pages=12, max_slots=8)
  prompt = list(map(int, np.random.default_rng(2).integers(3, 300, size=60)))
  with pytest.raises(ValueError, match=r"prompt 1 of 5 samples .* needs 12 pages .* the pool's 11"):
    eng.generate([prompt[:10], prompt], SamplingParams(max_new_tokens=2, n=5))
  # the largest group that fits (8 + 3 = 11 pages) runs, and runs right: equal to dense
  sp = SamplingParams(max_new_tokens=4, n=4, seed=2)
  res, ref = eng.generate([prompt], sp), _engine(model, "dense").generate([prompt], sp)
  for a, b in zip(res.completions, ref.completions, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_config_rejects_a_group_size_the_pool_can_never_hold():
  small = EngineConfig(max_seq_len=64, max_slots=8, page_size=8, num_pages=12)
  with pytest.raises(
    ValueError, match=r"sampling.group_size of 8 samples .* 15 pages .* pool's 11"
  ):
    GRPOConfig(rollout=small, sampling=SamplingSection(group_size=8, max_new_tokens=16))
  # 63-token prompt: 8 pages + 1 per extra sample; 4 samples fit 11 pages
  GRPOConfig(rollout=small, sampling=SamplingSection(group_size=4, max_new_tokens=16))


# ------------------------------------------------------------------- re-entrant engine (#19)
def _snapshot(res):
  return [(c.token_ids.copy(), c.logprobs.copy(), c.finish_reason) for c in res.completions]


def test_engine_called_again_leaves_an_earlier_result_unchanged(model, prompts):
  eng = _engine(
    model, "paged", num_pages=13
  )  # small pool: the second call preempts and reuses pages
  first = eng.generate(prompts[:3], SamplingParams(max_new_tokens=12, n=2, seed=7))
  before, stats = _snapshot(first), dataclasses.asdict(first.stats)
  second = eng.generate(prompts[3:], SamplingParams(max_new_tokens=20, n=2, seed=8))
  assert second.stats.preemptions > 0 and len(second.completions) == 6
  for (ids, lps, why), c in zip(before, first.completions, strict=True):
    np.testing.assert_array_equal(c.token_ids, ids)
    np.testing.assert_array_equal(c.logprobs, lps)
    assert c.finish_reason == why
  assert dataclasses.asdict(first.stats) == stats
  again = eng.generate(prompts[:3], SamplingParams(max_new_tokens=12, n=2, seed=7))
  for (ids, _, _), c in zip(before, again.completions, strict=True):  # nothing stale carried over
    np.testing.assert_array_equal(c.token_ids, ids)


def test_concurrent_generate_calls_do_not_share_scheduler_state(model, prompts):
  """Two threads on one engine: each call schedules its own slots, queues and pages (the second
  finds the spare cache taken and makes its own) and gets what it would get alone."""
  eng = _engine(model, "paged")
  jobs = [
    (prompts[:3], SamplingParams(max_new_tokens=16, n=2, seed=9)),
    (prompts[3:], SamplingParams(max_new_tokens=10, n=2, seed=10)),
  ]
  alone = [_snapshot(eng.generate(*job)) for job in jobs]
  start = threading.Barrier(2)

  def call(job):
    start.wait()
    return eng.generate(*job)

  with concurrent.futures.ThreadPoolExecutor(2) as ex:
    together = [_snapshot(r) for r in ex.map(call, jobs)]
  for a, b in zip(alone, together, strict=True):
    for (ids, lps, why), (ids2, lps2, why2) in zip(a, b, strict=True):
      np.testing.assert_array_equal(ids, ids2)
      np.testing.assert_allclose(lps, lps2, atol=1e-5)
      assert why == why2


@pytest.mark.parametrize("backend", ["paged", "dense"])
def test_a_sharded_model_prefills_without_recompiling_in_the_next_call(prompts, backend):
  """Issue 31: with the model on a mesh, the paged engine's KV cache was created on one device and
  took the mesh's sharding (KV heads over "tp") from its first decode, so the second generate's
  prefill, whose cache argument's sharding is part of jit's key, compiled again (a recompile per
  loop step 2 at the real shape). The caches are created with that sharding: the second call
  compiles nothing, and the cache keeps the sharding it was created with."""
  from jax.sharding import Mesh

  from rl.model import shard_model
  from tests.compiles import compiled_functions

  mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), ("dp", "fsdp", "tp"))
  sharded = shard_model(init_model(preset("tiny", dtype="float32"), seed=0), mesh)
  engine = _engine(sharded, backend)
  created = engine._spare_cache.k.sharding if backend == "paged" else None
  params = SamplingParams(max_new_tokens=6, n=2, seed=3)
  first = engine.generate(prompts[:2], params)
  with compiled_functions() as names:
    second = engine.generate(prompts[:2], params)
  assert names == [], names
  for a, b in zip(first.completions, second.completions, strict=True):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
  if backend == "paged":
    assert created.spec[0] == "tp"  # tiny: 2 KV heads over tp=2
    assert engine._spare_cache.k.sharding.is_equivalent_to(created, 4)
