"""The sort-free sampler against the sort-based reference definition (`processed_logprobs_sorted`):
the same probability vectors on every path (no filter, candidates, fallback sort), the same sample
frequencies from seeded draws, and the candidate path taken exactly when it is exact. The kept sets
are threshold sets (ties with the last kept token kept) and each draw's support gap reproduces its
kept set under kernels.support's rule."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.tolerances import assert_close
from kernels import support
from kernels.grpo_loss.reference import token_logps_and_entropy
from rl.model import init_model, preset
from rl.rollout.sampling import (
  BLOCK,
  candidate_threshold,
  processed_logprobs,
  processed_logprobs_sorted,
  sample,
  support_gaps,
)

ATOL = 1e-6  # probabilities: both sides are float32 softmaxes of the same logits


def _rows(rng, b, v, scale):  # [B, V] f32 logits
  return jnp.asarray(rng.normal(size=(b, v)) * scale, jnp.float32)


def _compare(logits, temperature, top_k, top_p, candidates, min_p=None):
  b = logits.shape[0]
  args = (
    logits,
    jnp.asarray(temperature, jnp.float32),
    jnp.asarray(top_k, jnp.int32),
    jnp.asarray(top_p, jnp.float32),
    jnp.zeros(b, jnp.float32) if min_p is None else jnp.asarray(min_p, jnp.float32),
  )
  new = np.asarray(jax.jit(processed_logprobs, static_argnums=5)(*args, candidates))
  ref = np.asarray(processed_logprobs_sorted(*args))
  # the same kept set (both are {z >= tau} with the same tau), the same probabilities
  np.testing.assert_array_equal(np.isfinite(new), np.isfinite(ref))
  # log-space rounding: z - logsumexp(z) carries an absolute error of a few ulps of the largest |z|
  t = np.where(np.asarray(temperature) > 0, temperature, 1.0)  # greedy rows: z = logits
  z = np.abs(np.asarray(logits) / t[:, None])
  rel = 4 * np.finfo(np.float32).eps * np.maximum(z.max(-1, keepdims=True), 1.0)
  err = np.abs(np.exp(new) - np.exp(ref)) - (ATOL + rel * np.exp(ref))
  assert (err <= 0).all(), (
    f"probabilities differ beyond rounding: {err.max():.3g} at {np.argmax(err)}"
  )
  np.testing.assert_allclose(np.exp(new).sum(-1), 1.0, atol=1e-5)
  return new, ref


# (top_k, top_p) per row: off, top-k inside / beyond the candidates / >= V, nucleus, both
PARAMS = [(0, 1.0), (5, 1.0), (50, 1.0), (400, 1.0), (0, 0.9), (0, 0.3), (10, 0.7), (3, 0.99)]


@pytest.mark.parametrize("scale", [1.0, 6.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("candidates", [16, 64])
def test_matches_the_sorted_reference_per_row(scale, candidates):
  rng = np.random.default_rng(0)
  b = len(PARAMS)
  logits = _rows(rng, b, 384, scale)
  top_k, top_p = zip(*PARAMS)
  temperature = rng.uniform(0.5, 1.5, size=b)
  temperature[0] = 0.0  # a greedy row: plain softmax
  new, _ = _compare(logits, temperature, top_k, top_p, candidates)
  kept = np.isfinite(new).sum(-1)
  assert kept[1] == 5 and kept[6] <= 10 and kept[7] <= 3  # the filters did act
  assert kept[0] == 384 and kept[3] == 384  # off, and top_k >= V is off


def test_batches_of_uniform_settings_take_each_path():
  """One setting for the whole batch, as a GRPO step samples: no filter (no sort), candidates
  (top-k <= C, or a nucleus inside C), fallback sort (top-k > C, or a nucleus wider than C)."""
  rng = np.random.default_rng(1)
  peaked, flat = _rows(rng, 6, 384, 6.0), _rows(rng, 6, 384, 0.5)
  ones = np.ones(6)
  for logits, k, p, exact in [
    (flat, 0, 1.0, None),
    (flat, 8, 1.0, True),
    (flat, 100, 1.0, False),
    (peaked, 0, 0.9, True),
    (flat, 0, 0.9, False),
    (flat, 100, 0.5, False),
  ]:
    top_k, top_p = np.full(6, k), np.full(6, p)
    _compare(logits, ones, top_k, top_p, 32)
    off = jnp.zeros(6)
    flags = np.asarray(
      candidate_threshold(logits, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p), off, 32)[1]
    )
    if exact is not None:  # whether the sampler may skip the sort (exact) or must sort (not)
      assert flags.all() if exact else not flags.any(), (k, p)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
  v=st.integers(2, 200),
  candidates=st.integers(1, 40),
  seed=st.integers(0, 2**32 - 1),
  ties=st.booleans(),
)
def test_matches_the_sorted_reference_on_drawn_shapes(v, candidates, seed, ties):
  rng = np.random.default_rng(seed)
  b = 6
  logits = rng.normal(size=(b, v)) * rng.uniform(0.3, 8.0)
  if ties:  # equal logits: both sides keep every token tied with the last kept one
    logits = np.round(logits)
  top_k = rng.integers(0, v + 3, size=b) * (rng.random(b) < 0.6)
  top_p = np.where(rng.random(b) < 0.6, rng.uniform(0.05, 1.0, size=b), 1.0)
  min_p = np.where(rng.random(b) < 0.4, rng.uniform(0.0, 0.5, size=b), 0.0)
  _compare(
    jnp.asarray(logits, jnp.float32),
    rng.uniform(0.3, 2.0, size=b),
    top_k,
    top_p,
    candidates,
    min_p,
  )


def test_top_p_one_is_off_in_both_forms():
  """p = 1 keeps the whole row in the sorted form too (tau_p = -inf), tokens of probability ~e^-30
  included: a float32 cumulative sum that reaches 1.0 early must not cut the tail."""
  logits = jnp.zeros((1, 384)).at[0, 7].set(30.0)
  args = (logits, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1))
  for form in (processed_logprobs, processed_logprobs_sorted):
    np.testing.assert_allclose(
      np.asarray(form(*args)), np.asarray(jax.nn.log_softmax(logits)), atol=1e-6
    )


def _kept(logits, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0):  # one row -> kept token ids
  one = lambda x, dt=jnp.float32: jnp.asarray([x], dt)
  lp = processed_logprobs(
    jnp.asarray([logits], jnp.float32),
    one(temperature),
    one(top_k, jnp.int32),
    one(top_p),
    one(min_p),
    candidates=4,
  )
  return set(np.flatnonzero(np.isfinite(np.asarray(lp)[0])).tolist())


def test_kept_sets_are_threshold_sets_ties_kept():
  """Ties with the last kept token are kept, by top-k (the 2nd largest value is shared by 3 tokens:
  top-k 2 keeps 4), by top-p (the nucleus ends on a tied value) and past the candidates (4 here).
  Catches a top-k that breaks ties by token id (then no gap can reproduce its set), and a kept set
  read off the candidates only."""
  row = [3.0, 1.0, 1.0, 0.0, 1.0, -1.0, 1.0, 1.0]  # 3 once, 1 five times
  assert _kept(row, top_k=2) == {0, 1, 2, 4, 6, 7}  # ties past the 4 candidates kept too
  assert _kept(row, top_k=1) == {0}
  # p(3) = e^3 / (e^3 + 5e + 1 + e^-1) ~ 0.58: the nucleus needs a 1, and so keeps all five
  assert _kept(row, top_p=0.6) == {0, 1, 2, 4, 6, 7}
  assert _kept(row, top_p=0.5) == {0}


def test_min_p_by_hand():
  """min-p keeps p_v >= m * p_max, i.e. z_v >= z_max + log m, at the sampling temperature, and is
  the intersection with top-k (their order does not matter)."""
  row = list(np.log([0.5, 0.25, 0.12, 0.12, 0.05]))
  assert _kept(row, min_p=0.2) == {0, 1, 2, 3}  # 0.12 >= 0.2 * 0.5 > 0.05
  assert _kept(row, min_p=0.3) == {0, 1}
  assert _kept(row, min_p=0.2, top_k=2) == {0, 1}
  # temperature 2: sqrt(0.12 / 0.5) = 0.49 >= 0.4 > sqrt(0.05 / 0.5) = 0.32
  assert _kept(row, min_p=0.4, temperature=2.0) == {0, 1, 2, 3}
  assert _kept(row, min_p=1.0) == {0}


def _gapped_set(logits, ids, gaps, temperature):  # -> [N, V] bool: S = {z >= z_y + g} per row
  z = jnp.asarray(logits, jnp.float32) / temperature[:, None]
  return np.isfinite(np.asarray(support.apply_gap(z, jnp.asarray(ids), jnp.asarray(gaps))))


@pytest.mark.parametrize(
  "top_k,top_p,min_p",
  [(20, 0.9, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (3, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.0)],
  ids=["k20+p0.9", "p0.8", "minp0.1", "k3-ties", "p0.5-ties", "off"],
)
def test_support_gaps_reproduce_the_kept_set_on_policy(top_k, top_p, min_p):
  """On the sampler's own logits, every draw's gap gives kernels.support the set it was drawn from,
  and the reference's truncated log-prob equals the sampler's within 1e-5 (f32), also where logits
  tie at the boundary (rounded logits). Catches a gap formed before the temperature, a gap that
  rounds so that the trainer's threshold z_y + g drops the set's smallest token, y dropped from its
  own set, and -inf gaps (unfiltered rows, greedy rows) turning into NaN log-probs."""
  n, v = 512, 96
  rng = np.random.default_rng(7)
  logits = rng.normal(size=(n, v)) * rng.uniform(0.5, 4.0, size=(n, 1))
  logits[: n // 2] = np.round(logits[: n // 2] * 2) / 2  # ties at every boundary
  logits = jnp.asarray(logits, jnp.float32)
  t = jnp.asarray(rng.uniform(0.4, 1.6, size=n), jnp.float32).at[:8].set(0.0)  # 8 greedy rows
  k, p, m = jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p), jnp.full(n, min_p)
  keys = jax.random.split(jax.random.key(8), n)
  tokens, logps, gaps = jax.jit(sample)(logits, keys, t, k, p, m)
  gaps = np.asarray(gaps)
  filtered = top_k > 0 or top_p < 1 or min_p > 0
  assert (gaps[:8] == -np.inf).all()  # greedy: the plain log-softmax, no gap
  assert (np.isfinite(gaps[8:]) if filtered else gaps[8:] == -np.inf).all()
  # the replay (what the trainer does for sglang_jax) reports the same gaps on the same logits
  np.testing.assert_array_equal(np.asarray(support_gaps(logits, tokens, t, k, p, m)), gaps)
  hot = slice(8, None)
  tk = jnp.where(t > 0, t, 1.0)
  kept = np.isfinite(np.asarray(processed_logprobs(logits, t, k, p, m)))
  np.testing.assert_array_equal(_gapped_set(logits, tokens, gaps, tk)[hot], kept[hot])
  trainer, entropy = jax.jit(jax.vmap(token_logps_and_entropy, in_axes=(0, 0, 0, 0)))(
    logits, tokens, tk, jnp.asarray(gaps)
  )
  np.testing.assert_allclose(np.asarray(trainer)[hot], np.asarray(logps)[hot], atol=1e-5, rtol=0)
  assert np.isfinite(np.asarray(trainer)).all() and np.isfinite(np.asarray(entropy)).all()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.8), (6, 0.9)])
def test_sample_frequencies_follow_the_reference_distribution(top_k, top_p):
  """20000 seeded draws of one row: empirical frequencies within 5 standard errors of the reference
  probabilities, nothing drawn outside its kept set, and each draw's log-prob the reference's."""
  n, v = 20_000, 12
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, v)) * 1.5, jnp.float32)
  logits = jnp.repeat(logits, n, axis=0)
  t, k, p = jnp.full(n, 0.9), jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p)
  m = jnp.zeros(n)
  keys = jax.random.split(jax.random.key(3), n)
  tokens, logps, _ = jax.jit(sample)(logits, keys, t, k, p, m)
  ref = np.asarray(processed_logprobs_sorted(logits[:1], t[:1], k[:1], p[:1], m[:1]))[0]
  probs = np.exp(ref)
  freq = np.bincount(np.asarray(tokens), minlength=v) / n
  assert (freq[probs == 0] == 0).all()
  assert (probs < 1).sum() >= 2  # a real distribution, not a point mass
  np.testing.assert_array_less(np.abs(freq - probs), 5 * np.sqrt(probs * (1 - probs) / n) + 1e-9)
  np.testing.assert_allclose(np.asarray(logps), ref[np.asarray(tokens)], atol=1e-5)


@pytest.mark.parametrize("v", [12, 2 * BLOCK + 37], ids=["one-block", "ragged-blocks"])
def test_plain_sampler_frequencies_follow_the_softmax(v):
  """The plain sampler (`filtered=False`: the two-level inverse CDF, one uniform per row): 20000
  seeded draws within 5 standard errors of softmax(logits / t) on the likeliest tokens, nothing of
  zero probability drawn (a -inf logit, and the padded tail of the last block), each draw's log-prob
  the log-softmax's, and greedy rows the argmax. Catches an off-by-one block / within-block index,
  a CDF that skips or double-counts a block, or padding drawn as a token."""
  n = 20_000
  row = np.random.default_rng(4).normal(size=v) * 2.0
  row[v // 2] = -np.inf  # never drawn
  logits = jnp.repeat(jnp.asarray(row[None], jnp.float32), n, axis=0)
  t = jnp.full(n, 0.8).at[:4].set(0.0)  # 4 greedy rows
  keys = jax.random.split(jax.random.key(5), n)
  tokens, logps, gaps = jax.jit(sample, static_argnums=6)(
    logits, keys, t, jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n), False
  )
  tokens, logps = np.asarray(tokens), np.asarray(logps)
  assert (np.asarray(gaps) == -np.inf).all()
  ref = np.asarray(jax.nn.log_softmax(logits[:1] / 0.8, axis=-1))[0]
  assert (tokens[:4] == np.argmax(row)).all()
  plain = np.asarray(jax.nn.log_softmax(logits[:1], axis=-1))[0]
  np.testing.assert_allclose(logps[:4], plain[tokens[:4]], atol=1e-5)
  hot, lp = tokens[4:], logps[4:]
  assert (hot >= 0).all() and (hot < v).all() and not (hot == v // 2).any()
  probs = np.exp(ref)
  freq = np.bincount(hot, minlength=v) / len(hot)
  top = np.argsort(-probs)[:10]
  np.testing.assert_array_less(
    np.abs(freq[top] - probs[top]), 5 * np.sqrt(probs[top] * (1 - probs[top]) / len(hot)) + 1e-9
  )
  np.testing.assert_allclose(lp, ref[hot], atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"], ids=["tied", "untied"])
def test_blocked_logits_are_the_logits_cut_into_blocks(name):
  """The LM head writing its logits in blocks (what the decode loop samples from): token
  n * BLOCK + k at [:, n, k], for a tied head (the [V, H] table) and an untied one ([H, V]).
  Catches a block cut across the hidden axis, or blocks laid out transposed (a token's logit read
  from another token's), and a block that does not divide the vocabulary accepted."""
  model = init_model(preset(name, dtype="float32"), seed=3)
  h = jax.random.normal(jax.random.key(0), (3, model.cfg.hidden_size))
  blocked = model.blocked_logits(h, BLOCK)
  assert blocked.shape == (3, model.cfg.vocab_size // BLOCK, BLOCK)
  assert_close(blocked.reshape(3, -1), model.logits(h), "value", jnp.float32, h.shape[-1])
  with pytest.raises(ValueError, match="block=100"):
    model.blocked_logits(h, 100)


def test_the_decode_draw_from_blocks_is_the_plain_samplers():
  """The decode loop's unfiltered draw (rl.rollout.steps.next_tokens: the blocked logits into
  `sample_blocked`) against `sample(model.logits(h), filtered=False)` on the same keys: the same
  tokens and log-probs, greedy rows included. Catches the decode loop drawing otherwise than the
  sampler the frequency tests above check: its blocks in another order, other keys or temperatures,
  or the padded [B, V] path and the blocked one parting ways."""
  from rl.rollout.steps import next_tokens

  model = init_model(preset("tiny", dtype="float32"), seed=4)
  n = 64
  h = jax.random.normal(jax.random.key(1), (n, model.cfg.hidden_size)) * 3.0
  keys = jax.random.split(jax.random.key(2), n)
  t = jnp.full(n, 0.9).at[:5].set(0.0)
  off_k, off_p, off_m = jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n)
  tokens, logps, gaps = next_tokens(model, h, keys, t, off_k, off_p, off_m, False)
  ref_tokens, ref_logps, _ = sample(model.logits(h), keys, t, off_k, off_p, off_m, False)
  assert (np.asarray(gaps) == -np.inf).all()
  np.testing.assert_array_equal(tokens, ref_tokens)
  assert_close(logps, ref_logps, "value", jnp.float32, model.cfg.vocab_size)
  assert (np.asarray(tokens[:5]) == np.argmax(np.asarray(model.logits(h[:5])), -1)).all()
