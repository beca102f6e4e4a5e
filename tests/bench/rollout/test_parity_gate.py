"""The rollout bench's parity gate (bench.rollout.parity): an f32 + "highest" run of each engine
against a teacher-forced forward at the same precision. It must pass a correct engine whatever the
platform's precision defaults, and fail an engine with a real cache bug injected (a shifted position,
a lost KV write whose page is then read stale), where the bug lives: in the engine's cache."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from bench.rollout import parity, throughput
from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, make_engine
from rl.rollout.paged import PagedEngine
from rl.rollout.paged_cache import PYTREE_FIELDS, PagedKVCache

SIZE = throughput.SIZES["tiny"]  # 2 prompts x 2 samples, 8 + 8 tokens, page 8, 4 steps per sync


@dataclasses.dataclass(frozen=True)
class _ShiftedCache(PagedKVCache):
  """Decode writes and attends one slot late (an off-by-one position in the decode step): each step
  sees a slot nothing was written to and its own key one slot later."""

  def attend(self, layer, q, k, v, positions, **kw):
    return super().attend(layer, q, k, v, positions + (q.shape[1] == 1), **kw)


@dataclasses.dataclass(frozen=True)
class _LostWriteCache(PagedKVCache):
  """A decode step's KV never lands in the pool (a write to a page the device table does not have
  yet): the step itself sees its key, every later step reads the page's stale contents."""

  def attend(self, layer, q, k, v, positions, **kw):
    out, cache = super().attend(layer, q, k, v, positions, **kw)
    return out, (self if q.shape[1] == 1 else cache)


for _cls in (_ShiftedCache, _LostWriteCache):
  jax.tree_util.register_dataclass(_cls, **PYTREE_FIELDS)


def _recycled(cache: PagedKVCache, cls) -> PagedKVCache:
  """`cache` as `cls`, its pool holding a previous call's values (random, finite): what a reused
  pool's free pages hold. A correct engine never reads a slot it did not write."""
  fill = lambda key: (3.0 * jax.random.normal(key, cache.k.shape)).astype(cache.dtype)
  store = lambda x: (
    x if cache.value_dtype is None else jax.lax.bitcast_convert_type(x, cache.k.dtype)
  )
  fields = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
  fields.update(k=store(fill(jax.random.key(1))), v=store(fill(jax.random.key(2))))
  return cls(**fields)


def _gate_engine(model, cls=PagedKVCache):
  class Engine(PagedEngine):
    def _new_cache(self):
      return _recycled(super()._new_cache(), cls)

  cfg = EngineConfig(
    backend="paged",
    max_seq_len=SIZE["prompt_len"] + SIZE["new_tokens"],
    max_slots=SIZE["prompts"] * SIZE["n"],
    page_size=SIZE["page_size"],
    steps_per_sync=SIZE["steps"],
    matmul_precision=parity.GATE_PRECISION,
  )
  return Engine(model, cfg, eos_ids=[])


@pytest.fixture(scope="module")
def models():
  bf16 = scale_weights(init_model(preset("tiny"), seed=0), 10.0)
  return bf16, parity.gate_model(bf16)


def test_gate_model_is_the_same_weights_in_f32_compute(models):
  """A twin built from other weights would let the gate pass an engine whose weights differ from the bench's."""
  bf16, twin = models
  assert twin.cfg.dtype == "float32" and bf16.cfg.dtype == "bfloat16"
  same = jax.tree.map(jnp.array_equal, nnx.state(bf16, nnx.Param), nnx.state(twin, nnx.Param))
  assert all(jax.tree.leaves(same))


@pytest.mark.parametrize(
  "cls", [_ShiftedCache, _LostWriteCache], ids=["shifted-position", "stale-page"]
)
def test_gate_passes_a_correct_engine_and_fails_an_injected_cache_bug(models, cls):
  """The gate on a recycled (random-filled) pool: a correct engine passes (5e-6 nats, 0.03 of the
  tolerance on CPU), the same engine with the bug in its cache fails by far (3.8 / 5.8 nats, ~2e4x the
  tolerance): a gate loose enough to pass bf16 rounding on a GPU must still catch these."""
  _, twin = models
  good = throughput.gate(_gate_engine(twin), SIZE, "fixed")
  assert good.err <= 1.0
  bad = throughput.gate(_gate_engine(twin, cls), SIZE, "fixed")
  assert bad.err > 10.0 and bad.max_abs_diff > 1e-2


def test_reduced_precision_fails_the_old_gate_and_passes_the_new(models):
  """The H100 failure, emulated on CPU. XLA:CPU ignores jax.default_matmul_precision, so the GPU's
  default for f32 dots (TF32 / bf16 operands) is emulated by its effect: the same weights decoded with
  bf16 operands. The old gate checked that run against the forward with the run's own dtype's "value"
  budget, here f32 (the f32 `h128` size ran at default precision): it fails a correct engine, by far.
  The new gate runs the engine and the forward at "highest" (IEEE f32 dots on the GPU too): passes.
  The reduced-precision run's divergence is rounding-sized in the unit the bench reports for its
  compute-dtype rows (`rounding_ulps`: bf16 ulps at the largest |logit|; 1.2 measured here), far from a
  cache bug's (millions, see above): reported, not gating."""
  bf16, twin = models
  prompts, params = throughput.workload(SIZE, "fixed")
  reduced = make_engine(bf16, _gate_engine(twin).config, eos_ids=[]).generate(prompts, params)
  old = parity.parity(twin, reduced, SIZE["prompt_len"], SIZE["new_tokens"])
  assert old.err > 10.0  # 362 measured
  assert throughput.gate(_gate_engine(twin), SIZE, "fixed").err <= 1.0
  ulps = old.max_abs_diff / (float(jnp.finfo(jnp.bfloat16).eps) * old.logit_scale)
  assert 0.1 < ulps < 4.0
