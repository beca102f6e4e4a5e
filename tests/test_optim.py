"""Fused AdamW / Lion against optax itself: 10 steps, 1 device and an 8-device fsdp x tp mesh."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from bench.shapes import decoder_param_shapes
from bench.tolerances import assert_close
from kernels import backend
from kernels.optim import ElementwiseBlocks

FAMILIES = {"tiled": "cpu", "rowloop": "gpu"}


def model_tree(seed=0):
  """Embeddings, matrices, vectors, a scalar and odd sizes."""
  rng = np.random.default_rng(seed)
  shapes = {
    "embed": (37, 24),
    "w": (24, 300),
    "b": (300,),
    "scale": (),
    "odd": (5, 7, 3),
    "lane": (8, 256),
  }
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


def run_steps(tx, params, steps=10, seed=1):
  rng = np.random.default_rng(seed)
  state = tx.init(params)
  step = jax.jit(lambda p, g, s: _apply(tx, p, g, s))
  for _ in range(steps):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    params, state = step(params, grads, state)
  return params, state


def _apply(tx, params, grads, state):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def assert_trees_close(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert_close(x, y, "optimizer", jnp.float32, 1, jax.tree_util.keystr(path))


OPTIMIZERS = {
  "adamw": (
    lambda **kw: kernels.fused_adamw(1e-2, weight_decay=0.1, **kw),
    optax.adamw(1e-2, weight_decay=0.1),
  ),
  "adamw_schedule_mask": (
    lambda **kw: kernels.fused_adamw(
      optax.cosine_decay_schedule(3e-3, 10),
      b2=0.95,
      weight_decay=0.05,
      mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()},
      **kw,
    ),
    optax.adamw(
      optax.cosine_decay_schedule(3e-3, 10),
      b2=0.95,
      weight_decay=0.05,
      mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()},
    ),
  ),
  "lion": (
    lambda **kw: kernels.fused_lion(1e-3, weight_decay=0.1, **kw),
    optax.lion(1e-3, weight_decay=0.1),
  ),
  "lion_clipped": (
    lambda **kw: optax.chain(optax.clip_by_global_norm(1.0), kernels.fused_lion(1e-3, **kw)),
    optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3)),
  ),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_ten_steps_match_optax_one_device(family, name):
  make, theirs = OPTIMIZERS[name]
  params = model_tree()
  ours, our_state = run_steps(
    make(impl="pallas", platform=FAMILIES[family], interpret=True), params
  )
  ref, ref_state = run_steps(theirs, params)
  assert_trees_close(ours, ref)
  inner = (
    our_state[-1] if isinstance(our_state, tuple) and not hasattr(our_state, "mu") else our_state
  )
  ref_inner = next(
    s for s in jax.tree.leaves(ref_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")
  )
  assert_trees_close(inner.mu, ref_inner.mu)
  assert int(inner.count) == 10


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_ten_steps_match_optax_on_fsdp_tp_mesh(name):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
  params = model_tree()
  specs = {
    "embed": P(None, "tp"),
    "w": P("fsdp", "tp"),
    "b": P("tp"),
    "scale": P(),
    "odd": P(),
    "lane": P("fsdp", "tp"),
  }
  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  make, theirs = OPTIMIZERS[name]
  tx = make(
    impl="pallas",
    platform="cpu",
    mesh=mesh,
    partition_specs=kernels.optim.partition_specs_of(placed),
  )
  ours, _state = run_steps(tx, placed)
  ref, _ = run_steps(theirs, params)
  assert_trees_close(ours, ref)
  for k in ours:  # updated in place on each shard: the parameters keep their shardings
    assert ours[k].sharding.is_equivalent_to(placed[k].sharding, ours[k].ndim), k
  # the jitted step holds no all-gather: each device touched only its own shard
  grads = jax.tree.map(jnp.ones_like, placed)
  hlo = jax.jit(lambda p, g, s: _apply(tx, p, g, s)).lower(placed, grads, tx.init(placed)).as_text()
  assert "all-gather" not in hlo and "all_gather" not in hlo


@given(
  shape=st.lists(st.integers(1, 40), min_size=0, max_size=3),
  family=st.sampled_from(sorted(FAMILIES)),
  lr=st.floats(1e-5, 1e-1),
  b1=st.floats(0.0, 0.99),
  b2=st.floats(0.5, 0.9999),
  wd=st.floats(0.0, 0.5),
  count=st.integers(0, 1000),
  bf16_master=st.booleans(),
  seed=st.integers(0, 2**32 - 1),
)
def test_adamw_update_matches_reference_hypothesis(
  shape, family, lr, b1, b2, wd, count, bf16_master, seed
):
  rng = np.random.default_rng(seed)  # drawn by hypothesis, so a failure reproduces
  p, g, mu = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3))
  nu = jnp.asarray(rng.random(size=shape), jnp.float32)
  # Outputs are sums of terms as large as the operands ((1-b)*g + b*mu can nearly cancel, and whether
  # XLA contracts it into an FMA differs between the fused and interpreted paths), so the rounding
  # budget is relative to the operands, not to the possibly tiny result.
  operand_scale = max(float(np.max(np.abs(np.asarray(a)), initial=0.0)) for a in (p, g, mu, nu))
  kw = dict(lr=lr, b1=b1, b2=b2, weight_decay=wd)
  param, master = (p.astype(jnp.bfloat16), p) if bf16_master else (p, None)
  ours = kernels.adamw_update(
    param,
    g,
    mu,
    nu,
    count,
    master=master,
    impl="pallas",
    platform=FAMILIES[family],
    interpret=True,
    blocks=_small_blocks(family),
    **kw,
  )
  ref = kernels.adamw_update(param, g, mu, nu, count, master=master, impl="xla", **kw)
  assert ours.param.dtype == param.dtype
  for a, b in zip(ours, ref):
    if b is not None:
      assert_close(
        a, b, "optimizer", a.dtype, 1, scale=max(operand_scale, float(np.max(np.abs(b))))
      )
  lion = kernels.lion_update(
    param,
    g,
    mu,
    master=master,
    impl="pallas",
    platform=FAMILIES[family],
    interpret=True,
    blocks=_small_blocks(family),
    lr=lr,
    b1=b1,
    b2=b2,
    weight_decay=wd,
  )
  lion_ref = kernels.lion_update(
    param, g, mu, master=master, impl="xla", lr=lr, b1=b1, b2=b2, weight_decay=wd
  )
  for a, b in zip(lion, lion_ref):
    if b is not None:
      assert_close(
        a, b, "optimizer", a.dtype, 1, scale=max(operand_scale, float(np.max(np.abs(b))))
      )


def _small_blocks(family):  # small tiles so ragged edges are exercised
  return ElementwiseBlocks(8, 128) if family == "tiled" else ElementwiseBlocks(1, 64)


def test_no_recompile_across_steps():
  tx = kernels.fused_adamw(1e-3, impl="pallas", platform="cpu")
  params = model_tree()
  state = tx.init(params)
  step = jax.jit(lambda p, g, s: _apply(tx, p, g, s), donate_argnums=(0, 2))
  for _ in range(3):
    params, state = step(params, jax.tree.map(jnp.ones_like, params), state)
  assert step._cache_size() == 1


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_lowers_real_kernel_at_1_5b_shapes(platform):
  """Every distinct parameter shape of Qwen2.5-1.5B, AdamW and Lion, lowered for the real backend."""
  shapes = sorted(set(decoder_param_shapes("qwen2.5-1.5b").values()))
  tree = {str(s): jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes}
  target = backend.make_target(platform, interpret=False)
  for make in (kernels.fused_adamw(1e-3), kernels.fused_lion(1e-3)):
    with backend.use_target(platform, interpret=False):
      state = jax.eval_shape(make.init, tree)
      text = (
        jax.jit(lambda p, g, s: _apply(make, p, g, s))  # noqa: B023 (traced at once)
        .trace(tree, tree, state)
        .lower(lowering_platforms=(target.lowering_platform,))
        .as_text()
      )
    assert text.count(backend.LOWERED_KERNEL_MARKERS[platform]) == len(shapes)


@pytest.mark.parametrize(
  "call,match",
  [
    (
      lambda: kernels.adamw_update(jnp.ones(3), jnp.ones(4), jnp.ones(3), jnp.ones(3), 0, lr=0.1),
      "grad shape",
    ),
    (
      lambda: kernels.adamw_update(
        jnp.ones(3, jnp.int32), jnp.ones(3), jnp.ones(3), jnp.ones(3), 0, lr=0.1
      ),
      "param must be floating",
    ),
    (
      lambda: kernels.adamw_update(
        jnp.ones(3), jnp.ones(3), jnp.ones(3, jnp.bfloat16), jnp.ones(3), 0, lr=0.1
      ),
      "mu must be float32",
    ),
    (
      lambda: kernels.adamw_update(
        jnp.ones(3), jnp.ones(3), jnp.ones(3), jnp.ones(3), 0, lr=0.1, b1=1.0
      ),
      r"b1 must be in \[0, 1\)",
    ),
    (
      lambda: kernels.lion_update(jnp.ones(3), jnp.ones(3), jnp.ones(3), lr=0.1, weight_decay=-1.0),
      "weight_decay must be >= 0",
    ),
    (
      lambda: kernels.fused_adamw(1e-3).update(
        {"a": jnp.ones(2)}, kernels.fused_adamw(1e-3).init({"a": jnp.ones(2)})
      ),
      "needs params",
    ),
    (
      lambda: kernels.fused_adamw(1e-3, impl="pallas", platform="cpu").update(
        {"a": jnp.ones(2), "b": jnp.ones(2)},
        kernels.fused_adamw(1e-3).init({"a": jnp.ones(2)}),
        {"a": jnp.ones(2)},
      ),
      "tree structure mismatch",
    ),
    (
      lambda: kernels.adamw_update(
        jnp.ones(3), jnp.ones(3), jnp.ones(3), jnp.ones(3), 0, lr=0.1, impl="cuda"
      ),
      "impl must be",
    ),
  ],
)
def test_bad_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("which", ["adamw", "lion"])
def test_in_place_step_matches_optax(family, which):
  make = kernels.optim.fused_adamw_step if which == "adamw" else kernels.optim.fused_lion_step
  theirs = (
    optax.adamw(1e-2, weight_decay=0.1) if which == "adamw" else optax.lion(1e-3, weight_decay=0.1)
  )
  tx, step = make(
    1e-2 if which == "adamw" else 1e-3,
    weight_decay=0.1,
    impl="pallas",
    platform=FAMILIES[family],
    interpret=True,
  )
  params = model_tree()
  state = tx.init(params)
  rng = np.random.default_rng(3)
  jstep = jax.jit(step, donate_argnums=(0, 2))
  ref, ref_state = params, theirs.init(params)
  for _ in range(10):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    ref, ref_state = _apply(theirs, ref, grads, ref_state)
    params, state = jstep(params, grads, state)
  assert_trees_close(params, ref)
