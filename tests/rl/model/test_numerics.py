"""Batch-invariant numerics (ModelConfig.batch_invariant, rl.model.numerics): a token's hidden state has
the same bits in a cached decode step as in the teacher-forced forward, the invariant path computes
the model's function, and a cache that cannot be invariant refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.tolerances import assert_close
from rl.model import DenseKVCache, init_model, numerics, preset, scale_weights
from rl.rollout import EngineConfig, make_engine
from rl.update import pack


def test_pairwise_sum_ignores_the_row_count_and_a_zero_tail():
  """Catches a denominator whose order depends on how many rows are summed at once or on how far
  the masked tail runs: a 1-query decode step and a 48-query forward (or a longer page gather) then
  differ in the last bits, which a bf16 rounding turns into a different token state."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(48, 37)) * 100, jnp.float32)
  total = jax.jit(numerics.pairwise_sum)
  all_rows = np.asarray(total(x))
  np.testing.assert_allclose(all_rows, np.asarray(x, np.float64).sum(-1), rtol=1e-5, atol=1e-3)
  for i in (0, 17, 47):
    assert np.asarray(total(x[i : i + 1]))[0] == all_rows[i]
  tail = jnp.concatenate([x, jnp.zeros((48, 91), jnp.float32)], axis=-1)
  np.testing.assert_array_equal(np.asarray(total(tail)), all_rows)
  assert float(numerics.pairwise_sum(jnp.ones((1,)))) == 1.0


def test_round_to_rounds_like_a_cast():
  """Catches a rounding that is not the cast's (truncation, or exponent and mantissa bits swapped:
  the decoder's invariant path would then compute another function than its default) and an f32
  "rounding" that changes values."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=(257,)) * 30, jnp.float32)
  got = jax.jit(lambda v: numerics.round_to(v * 1.7, jnp.bfloat16))(x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got), np.asarray((x * 1.7).astype(jnp.bfloat16)))
  np.testing.assert_array_equal(np.asarray(numerics.round_to(x, jnp.float32)), np.asarray(x))


def _model(name, dtype="bfloat16", invariant=True, seed=0):
  """x10 weights (peaked, as bench.mismatch), and biases and norm scales moved off their init (0 and
  1), so the invariant path's bias and scale roundings are exercised."""
  cfg = preset(name, dtype=dtype, batch_invariant=invariant)
  model = scale_weights(init_model(cfg, seed=seed), 10.0)
  keys = iter(jax.random.split(jax.random.key(seed + 100), 1000))

  def perturb(path, x):
    name = jax.tree_util.keystr(path)
    if "bias" in name or "norm" in name:
      return x * (1 + 0.3 * jax.random.normal(next(keys), x.shape)) + 0.3 * ("bias" in name)
    return x

  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree_util.tree_map_with_path(perturb, params))
  return model


@pytest.mark.parametrize("name,batch", [("tiny-h128", 4), ("cpu-small", 1), ("tiny-qwen3", 4)])
def test_decode_gives_the_teacher_forced_bits(name, batch):
  """bf16, x10 weights (peaked, as bench.mismatch): prefill 16 tokens, then decode 32 through the
  dense cache one at a time; every hidden state equals the full forward's bit for bit. Catches a
  reduction, a matmul or a fused rounding whose result depends on the query count: with XLA's
  default numerics 12% (tiny-h128, 4 sequences) and 66% (cpu-small, one sequence: one-row
  matmuls) of these decode states differ. tiny-qwen3 adds the q / k norms; biases and norm scales
  are off their init (see _model)."""
  model = _model(name)
  cfg = model.cfg
  prompt, new = 16, 32
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (batch, prompt + new)), jnp.int32)
  graphdef, state = nnx.split(model)
  full = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, tokens)
  step = jax.jit(lambda st, t, p, c: nnx.merge(graphdef, st).forward_with_cache(t, p, c))
  cache = DenseKVCache.create(
    cfg.num_layers, batch, prompt + new, cfg.num_kv_heads, cfg.dim_per_head, cfg.compute_dtype
  )
  positions = jnp.broadcast_to(jnp.arange(prompt), (batch, prompt))
  hidden, cache = step(state, tokens[:, :prompt], positions, cache)
  states = [hidden]
  for i in range(prompt, prompt + new):
    pos = jnp.full((batch, 1), i, jnp.int32)
    hidden, cache = step(state, tokens[:, i : i + 1], pos, cache)
    states.append(hidden)
  decoded = np.asarray(jnp.concatenate(states, axis=1).astype(jnp.float32))
  np.testing.assert_array_equal(decoded, np.asarray(full.astype(jnp.float32)))


def test_left_padded_trainer_rows_give_the_engines_bits():
  """The trainer's rows are [left-padded prompt | completion] (rl.update.pack); an engine's cache
  holds a sequence from slot 0 (right-padded prompts). Catches a teacher-forced forward whose key
  columns are not the cache's slots: the pairwise sums then pair other terms and the states differ
  in their last bits (the forward compacts each row's real tokens to its front; without that, this
  test fails)."""
  model = _model("cpu-small")
  cfg = model.cfg
  lengths, width, new = np.array([31, 9, 13, 5, 22, 17]), 32, 40
  b = len(lengths)
  seqs = np.random.default_rng(0).integers(3, 200, (b, width + new))
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda st, t, p, c: nnx.merge(graphdef, st).forward_with_cache(t, p, c))
  cache = DenseKVCache.create(
    cfg.num_layers, b, width + new, cfg.num_kv_heads, cfg.dim_per_head, cfg.compute_dtype
  )
  prompts = np.where(np.arange(width) < lengths[:, None], seqs[:, :width], 0)
  positions = jnp.broadcast_to(jnp.arange(width), (b, width))
  hidden, cache = step(state, jnp.asarray(prompts), positions, cache)
  states = [hidden[np.arange(b), lengths - 1]]  # each predicts completion token 0
  for i in range(new - 1):
    pos = jnp.asarray(lengths + i)[:, None]
    hidden, cache = step(state, jnp.asarray(seqs[:, width + i])[:, None], pos, cache)
    states.append(hidden[:, 0])
  tokens, mask = pack(
    [seqs[r, : lengths[r]] for r in range(b)], list(seqs[:, width:]), width, new, pad_id=0
  )
  full = jax.jit(lambda st, t, m: nnx.merge(graphdef, st)(t, m))(state, tokens, mask)
  decoded = jnp.stack(states, axis=1).astype(jnp.float32)
  want = full[:, width - 1 : width - 1 + new].astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(decoded), np.asarray(want))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-h128"])
def test_the_invariant_path_computes_the_same_function(name):
  """In f32 the invariant path rounds nothing, so only summation order separates it from the default:
  catches a dropped bias or norm scale, a softmax or p @ v over the wrong axis, and a row compaction
  that loses a token or its position. Rows with holes in the mask and explicit positions, compared
  at the real tokens; the gradient of a masked loss too."""
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(3, 200, (3, 13)), jnp.int32)
  mask = jnp.asarray(rng.random((3, 13)) > 0.3).at[:, 0].set(True)
  positions = jnp.asarray(np.cumsum(rng.integers(1, 3, (3, 13)), axis=1), jnp.int32)
  plain, inv = (_model(name, "float32", flag, seed=2) for flag in (False, True))
  cfg = plain.cfg
  depth = max(cfg.hidden_size, cfg.intermediate_size) * cfg.num_layers

  def loss(model):  # [] f32: the masked mean log-likelihood of the next tokens
    logits = model.logits(model(tokens, mask, positions))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(jnp.where(mask[:, 1:] & mask[:, :-1], logp, 0.0)) / 10.0, logits

  value_and_grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
  (want, want_logits), want_grad = value_and_grad(plain)
  (got, got_logits), got_grad = value_and_grad(inv)
  real = np.asarray(mask)
  assert_close(
    np.asarray(got_logits)[real], np.asarray(want_logits)[real], "value", jnp.float32, depth
  )
  assert_close(got, want, "value", jnp.float32, depth)
  for g, w in zip(jax.tree.leaves(nnx.state(got_grad)), jax.tree.leaves(nnx.state(want_grad))):
    assert_close(g, w, "value", jnp.float32, depth, scale=float(jnp.max(jnp.abs(w))) + 1e-3)


def test_a_paged_decode_kernel_refuses_batch_invariant_numerics():
  """A Pallas decode kernel sums in its own order: asking for invariant numerics through it is an
  error naming the setting when the engine is built, not a silently different engine (the XLA
  attention's runs: tests/bench/test_mismatch_bench.py's batch-invariant rows)."""
  model = _model("tiny")
  cfg = EngineConfig(backend="paged", max_seq_len=24, max_slots=2, page_size=8, attn_impl="pallas")
  with pytest.raises(ValueError, match=r"batch_invariant.*attn_impl='xla'.*'pallas'"):
    make_engine(model, cfg, eos_ids=[])
