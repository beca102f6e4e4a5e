"""Fused AdamW / Lion / SGD against optax itself: 10 steps, 1 device and an 8-device fsdp x tp mesh;
the kernel against the reference built from the same rule; every bad hyperparameter a ValueError."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from bench.shapes import decoder_param_shapes
from bench.tolerances import assert_close
from kernels import backend
from kernels.optim import ElementwiseBlocks, MultiTensorBlocks
from tests.compiles import compile_events

FAMILIES = {"tiled": "cpu", "rowloop": "gpu"}


def model_tree(seed=0):
  """Embeddings, matrices, vectors (one a multiple of 128: the TPU kernel sees it as [2, 128]), a
  scalar and odd sizes."""
  rng = np.random.default_rng(seed)
  shapes = {
    "embed": (37, 24),
    "w": (24, 300),
    "b": (300,),
    "norm": (256,),
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
  "sgd": (
    lambda **kw: kernels.fused_sgd(3e-2, momentum=0.9, **kw),
    optax.sgd(3e-2, momentum=0.9),
  ),
  # a schedule, Nesterov, and optax's own masked weight decay chained in front of the fused update
  "sgd_nesterov_masked_decay": (
    lambda **kw: optax.chain(
      optax.add_decayed_weights(0.1, mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()}),
      kernels.fused_sgd(optax.linear_schedule(3e-2, 1e-2, 10), 0.8, nesterov=True, **kw),
    ),
    optax.chain(
      optax.add_decayed_weights(0.1, mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()}),
      optax.sgd(optax.linear_schedule(3e-2, 1e-2, 10), 0.8, nesterov=True),
    ),
  ),
}


def fused_state(state) -> kernels.optim.FusedState:
  """The FusedState inside a (possibly chained) optimizer state."""
  is_fused = lambda s: isinstance(s, kernels.optim.FusedState)
  return next(s for s in jax.tree.leaves(state, is_leaf=is_fused) if is_fused(s))


def optax_slot(state, name):
  """The optax state field ``name`` (mu / nu / trace) inside a chained optax state (a NamedTuple
  field, not an attribute: jax arrays have a ``.trace`` method)."""
  has = lambda s: name in getattr(s, "_fields", ())
  return next(getattr(s, name) for s in jax.tree.leaves(state, is_leaf=has) if has(s))


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
  inner = fused_state(our_state)
  for slot, tree in inner.slots.items():
    assert_trees_close(tree, optax_slot(ref_state, slot))
  assert int(inner.count) == 10  # the count drives bias corrections and schedules


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd"])
def test_ten_steps_match_optax_on_fsdp_tp_mesh(name):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
  params = model_tree()
  specs = {
    "embed": P(None, "tp"),
    "w": P("fsdp", "tp"),
    "b": P("tp"),
    "norm": P("tp"),
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
  nesterov=st.booleans(),
  bf16_master=st.booleans(),
  seed=st.integers(0, 2**32 - 1),
)
def test_kernel_matches_reference_of_same_rule_hypothesis(
  shape, family, lr, b1, b2, wd, count, nesterov, bf16_master, seed
):
  """The Pallas pass vs the pure-JAX body of the same rule, ragged tiles, bf16 param + f32 master."""
  rng = np.random.default_rng(seed)  # drawn by hypothesis, so a failure reproduces
  p, g, mu = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3))
  nu = jnp.asarray(rng.random(size=shape), jnp.float32)
  # Outputs are sums of terms as large as the operands ((1-b)*g + b*mu can nearly cancel, and whether
  # XLA contracts it into an FMA differs between the fused and interpreted paths), so the rounding
  # budget is relative to the operands, not to the possibly tiny result.
  operand_scale = max(float(np.max(np.abs(np.asarray(a)), initial=0.0)) for a in (p, g, mu, nu))
  param, master = (p.astype(jnp.bfloat16), p) if bf16_master else (p, None)
  kernel = kernels.optim.KernelOptions("pallas", FAMILIES[family], True, _small_blocks(family))
  xla = kernels.optim.KernelOptions("xla")
  for rule, slots in (
    (kernels.optim.AdamW(b1, b2, 1e-8, wd), (mu, nu)),
    (kernels.optim.Lion(b1, b2, wd), (mu,)),
    (kernels.optim.SGD(b1, nesterov), (mu,)),
  ):
    ours, ref = (
      kernels.optim.apply_rule(rule, param, g, slots, count, lr=lr, master=master, options=o)
      for o in (kernel, xla)
    )
    assert ours.param.dtype == param.dtype
    assert (ours.master is None) == (master is None)  # the f32 master is written back, not dropped
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
      scale = max(operand_scale, float(np.max(np.abs(np.asarray(b, np.float32)), initial=0.0)))
      assert_close(a, b, "optimizer", a.dtype, 1, f"{type(rule).__name__}", scale=scale)


def _small_blocks(
  family,
):  # small tiles / chunks so ragged edges and multi-step programs are exercised
  return ElementwiseBlocks(8, 128) if family == "tiled" else MultiTensorBlocks(128, 256, 4)


@pytest.mark.parametrize("which", ["adamw_tx", "sgd_step"])
def test_no_recompile_across_steps(which):
  """Steps 2 and 3 reuse step 1's executable: the new state keeps the avals of the old (a count that
  changed dtype or a slot that came back bf16 would retrace every step)."""
  if which == "adamw_tx":
    tx = kernels.fused_adamw(optax.cosine_decay_schedule(1e-3, 10), impl="pallas", platform="cpu")
    step = jax.jit(lambda p, g, s: _apply(tx, p, g, s), donate_argnums=(0, 2))
  else:
    tx, fused_step = kernels.fused_sgd_step(1e-2, nesterov=True, impl="pallas", platform="cpu")
    step = jax.jit(fused_step, donate_argnums=(0, 2))
  params = model_tree()
  state = tx.init(params)
  params, state = step(params, jax.tree.map(jnp.ones_like, params), state)  # compiles
  with compile_events() as compiles:
    for _ in range(2):
      params, state = step(params, jax.tree.map(jnp.ones_like, params), state)
  assert not compiles, compiles


def _lowered_text(make, tree, platform, target):
  with backend.use_target(platform, interpret=False):
    state = jax.eval_shape(make.init, tree)
    return (
      jax.jit(lambda p, g, s: _apply(make, p, g, s))
      .trace(tree, tree, state)
      .lower(lowering_platforms=(target.lowering_platform,))
      .as_text()
    )


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_lowers_real_kernel_at_1_5b_shapes(platform):
  """Every distinct parameter shape of Qwen2.5-1.5B, AdamW, Lion and SGD, lowered for the real
  backend from this host: one launch for the whole tree (Triton on GPU, Mosaic on TPU; a per-leaf
  fallback would count 7)."""
  shapes = sorted(set(decoder_param_shapes("qwen2.5-1.5b").values()))
  tree = {str(s): jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes}
  target = backend.make_target(platform, interpret=False)
  for make in (kernels.fused_adamw(1e-3), kernels.fused_lion(1e-3), kernels.fused_sgd(1e-3)):
    text = _lowered_text(make, tree, platform, target)
    assert text.count(backend.LOWERED_KERNEL_MARKERS[platform]) == 1


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("which", ["adamw", "sgd"])
def test_in_place_step_aliases_param_and_state_buffers(platform, which):
  """The in-place step's kernel writes param and every state slot into their input buffers (one
  output_operand_alias each); the optax-API kernel, whose inputs are still live, aliases nothing."""
  make = kernels.fused_adamw_step if which == "adamw" else kernels.fused_sgd_step
  tx, step = make(1e-3)
  n_slots = len(fused_state(jax.eval_shape(tx.init, {"x": jnp.ones(1)})).slots)
  tree = {
    "w": jax.ShapeDtypeStruct((256, 512), jnp.float32),
    "b": jax.ShapeDtypeStruct((37,), jnp.float32),
  }
  target = backend.make_target(platform, interpret=False)
  with backend.use_target(platform, interpret=False):
    state = jax.eval_shape(tx.init, tree)
    in_place = (
      jax.jit(step, donate_argnums=(0, 2))
      .trace(tree, tree, state)
      .lower(lowering_platforms=(target.lowering_platform,))
      .as_text()
    )
  alias = "stablehlo.output_operand_alias<"
  assert in_place.count(alias) == len(tree) * (1 + n_slots)
  assert _lowered_text(tx, tree, platform, target).count(alias) == 0


def test_traced_non_finite_lr_gives_nan_not_an_error():
  """Under jit the learning rate is not concrete, so it cannot be range-checked: the documented
  behaviour is NaN parameters (never finite garbage), pinned here."""
  x = jnp.ones(3)
  out = jax.jit(lambda lr: kernels.adamw_update(x, x, x, x, 0, lr=lr).param)(jnp.nan)
  assert bool(jnp.all(jnp.isnan(out)))


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
      lambda: kernels.optim.apply_rule(
        kernels.optim.AdamW(), jnp.ones(3), jnp.ones(3), (jnp.ones(3),), 0, lr=0.1
      ),
      r"AdamW takes state \('mu', 'nu'\)",
    ),
    (lambda: kernels.optim.AdamW(b1=1.0), r"b1 must be a finite number in \[0, 1\), got 1$"),
    (lambda: kernels.optim.AdamW(b2=-0.1), r"b2 must be a finite number in \[0, 1\), got -0.1"),
    (lambda: kernels.optim.AdamW(b2=float("nan")), r"b2 must be a finite .*, got nan"),
    (lambda: kernels.optim.AdamW(eps=0.0), r"eps must be a finite number in \(0, inf\), got 0"),
    (lambda: kernels.optim.Lion(b1="0.9"), r"b1 must be a real number in \[0, 1\), got '0.9'"),
    (lambda: kernels.optim.SGD(momentum=1.0), r"momentum must be a finite number in \[0, 1\)"),
    (lambda: kernels.optim.SGD(nesterov="yes"), "nesterov must be a bool"),
    (
      lambda: kernels.adamw_update(
        jnp.ones(3), jnp.ones(3), jnp.ones(3), jnp.ones(3), 0, lr=float("nan")
      ),
      r"lr must be a finite number in \[0, inf\), got nan",
    ),
    (
      lambda: kernels.adamw_update(jnp.ones(3), jnp.ones(3), jnp.ones(3), jnp.ones(3), -1, lr=0.1),
      r"count must be a finite number in \[0, inf\), got -1",
    ),
    (
      lambda: kernels.lion_update(jnp.ones(3), jnp.ones(3), jnp.ones(3), lr=0.1, weight_decay=-1.0),
      r"weight_decay must be a finite number in \[0, inf\), got -1",
    ),
    (
      lambda: kernels.sgd_update(jnp.ones(3), jnp.ones(3), jnp.ones(3), lr=jnp.asarray(jnp.inf)),
      "lr must be a finite number",
    ),
    (lambda: kernels.fused_adamw(float("inf")), "learning_rate must be a finite number"),
    (lambda: kernels.fused_lion(-1e-3), r"learning_rate must be .* \[0, inf\), got -0.001"),
    (lambda: kernels.fused_lion(1e-3, weight_decay=float("nan")), "weight_decay must be a finite"),
    (lambda: kernels.fused_sgd(1e-3, mask=lambda p: p), "SGD has none"),
    (lambda: kernels.fused_sgd(1e-3, mesh=object()), "pass both mesh and partition_specs"),
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
      "updates: tree structure mismatch",
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
def test_empty_arrays_are_a_no_op(family):
  """impl="pallas" on size-0 arrays: nothing to tile, so the update is the (empty) no-op, alone and
  as one leaf of a tree whose other leaves still match optax."""
  kw = dict(impl="pallas", platform=FAMILIES[family], interpret=True)
  z = jnp.zeros((0, 4), jnp.float32)
  out = kernels.adamw_update(z.astype(jnp.bfloat16), z, z, z, 0, lr=0.1, master=z, **kw)
  assert [(a.shape, a.dtype) for a in out] == [((0, 4), jnp.bfloat16)] + [((0, 4), jnp.float32)] * 3
  params = {"empty": jnp.zeros((0,), jnp.float32), "w": model_tree()["w"]}
  ours, _ = run_steps(kernels.fused_adamw(1e-2, **kw), params, steps=2)
  ref, _ = run_steps(optax.adamw(1e-2), params, steps=2)
  assert_trees_close(ours, ref)
  assert ours["empty"].shape == (0,)


STEPS = {
  "adamw": (kernels.fused_adamw_step, dict(learning_rate=1e-2, weight_decay=0.1), optax.adamw),
  "lion": (kernels.fused_lion_step, dict(learning_rate=1e-3, weight_decay=0.1), optax.lion),
  "sgd": (kernels.fused_sgd_step, dict(learning_rate=3e-2, momentum=0.9, nesterov=True), optax.sgd),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("which", STEPS)
def test_in_place_step_matches_optax(family, which):
  make, hyper, theirs = STEPS[which]
  tx, step = make(**hyper, impl="pallas", platform=FAMILIES[family], interpret=True)
  theirs = theirs(**hyper)
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
  for slot, tree in state.slots.items():
    assert_trees_close(tree, optax_slot(ref_state, slot))


def test_sgd_update_needs_no_params_like_optax_sgd():
  """optax.sgd's update takes no params; neither does the fused one (only weight decay reads them)."""
  params = model_tree()
  grads = jax.tree.map(lambda x: x * 0.5 + 0.25, params)
  tx, ref = kernels.fused_sgd(1e-2, 0.9, impl="pallas", platform="cpu"), optax.sgd(1e-2, 0.9)
  ours, _ = tx.update(grads, tx.init(params))
  theirs, _ = ref.update(grads, ref.init(params))
  assert_trees_close(ours, theirs)


# --------------------------------------------------------------------------- one launch per tree
def _pallas_calls(fn, *args) -> int:
  """pallas_call equations in ``fn``'s jaxpr, nested ones (shard_map, cond) included."""
  return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def _wide_tree(n_leaves=64):
  """Many small leaves of ragged sizes and a bf16 leaf (the production trees' 290 / 338 leaves are
  counted by the CUDA lowering in tests/kernels/test_lowering.py; tracing them here would cost minutes)."""
  rng = np.random.default_rng(4)
  tree = {
    f"l{i:03d}": jnp.asarray(rng.normal(size=(1 + i % 7, 3 + i % 5)), jnp.float32)
    for i in range(n_leaves)
  }
  tree["half"] = tree.pop("l000").astype(jnp.bfloat16)
  return tree


@pytest.mark.parametrize(
  "family,which", [("rowloop", w) for w in STEPS] + [("tiled", "adamw")]
)  # the tiled family's rules differ only in their bodies: one of them traces its walk (~10 s)
def test_one_launch_for_the_whole_tree(family, which):
  """Both families' step and optax-API update each trace to ONE kernel for a 64-leaf tree with a
  bf16 leaf and a weight-decay mask (a per-leaf loop, or a launch per dtype / mask value, would show
  up as 64 or several)."""
  make, hyper, _ = STEPS[which]
  kw = dict(impl="pallas", platform=FAMILIES[family], interpret=True)
  if which != "sgd":
    kw["mask"] = lambda p: {k: v.ndim == 2 and v.shape[0] > 1 for k, v in p.items()}
  tx, step = make(**hyper, **kw)
  params = _wide_tree()
  state = tx.init(params)
  assert _pallas_calls(step, params, params, state) == 1
  assert _pallas_calls(lambda p, g, s: _apply(tx, p, g, s), params, params, state) == 1


def test_one_launch_matches_optax_over_ragged_mixed_tree():
  """The (leaf, chunk) walk with many leaves and chunks: every leaf lands in its own program range
  (an off-by-one in the program -> leaf map corrupts a neighbour) — 2 steps against optax, the bf16
  leaf against optax run in f32 then cast."""
  params = _wide_tree(9)
  blocks = MultiTensorBlocks(128, 256, 4)
  tx, step = kernels.fused_adamw_step(
    1e-2, weight_decay=0.1, impl="pallas", platform="gpu", interpret=True, blocks=blocks
  )
  params["big"] = jnp.asarray(np.random.default_rng(5).normal(size=(3, 700)), jnp.float32)
  ref = {k: v.astype(jnp.float32) for k, v in params.items()}
  theirs = optax.adamw(1e-2, weight_decay=0.1)
  state, ref_state = tx.init(params), theirs.init(ref)
  jstep = jax.jit(step, donate_argnums=(0, 2))
  rng = np.random.default_rng(6)
  for _ in range(2):
    grads = {k: jnp.asarray(rng.normal(size=v.shape), v.dtype) for k, v in params.items()}
    ref, ref_state = _apply(
      theirs, ref, jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state
    )
    params, state = jstep(params, grads, state)
  f32 = {k: v for k, v in params.items() if k != "half"}
  assert_trees_close(f32, {k: ref[k] for k in f32})
  assert params["half"].dtype == jnp.bfloat16
  assert_close(
    params["half"], ref["half"].astype(jnp.bfloat16), "optimizer", jnp.bfloat16, 1, "half"
  )


def test_fsdp_step_compiles_without_collectives_in_one_launch():
  """On the 8-device mesh the multi-tensor step runs under ONE shard_map with each leaf's own spec:
  one kernel, and the compiled step holds no all-gather / all-reduce / all-to-all / permute (a
  spec mismatch would make XLA gather the full parameters to each device)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
  params = model_tree()
  specs = {"embed": P(None, "tp"), "w": P("fsdp", "tp"), "b": P("tp"), "scale": P(), "odd": P()}
  specs["norm"] = P("tp")
  specs["lane"] = P("fsdp", "tp")
  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  tx, step = kernels.fused_adamw_step(
    1e-3,
    impl="pallas",
    platform="gpu",
    interpret=True,
    mesh=mesh,
    partition_specs=kernels.optim.partition_specs_of(placed),
  )
  state = jax.jit(tx.init)(placed)
  assert _pallas_calls(step, placed, placed, state) == 1
  compiled = jax.jit(step, donate_argnums=(0, 2)).lower(placed, placed, state).compile().as_text()
  for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
    assert collective not in compiled, collective


def test_pointer_budget_splits_only_past_it():
  """One launch while the operands fit CUDA's kernel-parameter space; a tree past MAX_POINTERS
  buffers splits into consecutive launches that cover every leaf once (none dropped or doubled)."""
  from kernels.optim import pallas_triton as multi
  from kernels.optim.work import LeafWork

  leaf = LeafWork(None, dict.fromkeys("pgmv"), dict.fromkeys("pmv"))  # AdamW: 7 buffers
  fits = multi.MAX_POINTERS // 7
  assert multi._pointer_groups([leaf] * fits) == [list(range(fits))]
  groups = multi._pointer_groups([leaf] * (fits + 1))
  assert len(groups) == 2 and groups[0] + groups[1] == list(range(fits + 1))


# --------------------------------------------------------------------------- blocks and evidence
def test_multi_tensor_blocks_validate_and_candidates_are_legal():
  """Illegal steps (not a power of two, a chunk that is not a multiple, too many values per thread)
  fail by name; the autotuner's grid is legal, unique and starts with the heuristic."""
  for kw, match in (
    (dict(block=1000), "block must be a power of two"),
    (dict(block=1024, chunk=1536), "chunk must be block x"),
    (dict(num_warps=3), "num_warps must be 1, 2, 4, 8 or 16"),
    (dict(block=16384, chunk=16384, num_warps=4), "at most 64"),
    (dict(block=True), "block must be a positive int"),
  ):
    with pytest.raises(ValueError, match=match):
      MultiTensorBlocks(**kw)
  cands = kernels.optim.candidate_blocks(4, 3)
  assert cands[0] == kernels.optim.default_blocks(4) and len(set(cands)) == len(cands) > 4
  from kernels.optim.pallas_blocks import estimated_registers

  assert all(estimated_registers(b, 4) <= 128 for b in cands)
  with pytest.raises(ValueError, match="n_inputs"):
    kernels.optim.candidate_blocks(0, 3)


def test_launch_evidence_by_hand_and_docstring_table():
  """The evidence function on a tree small enough to count by hand, and the docstring's table
  regenerated from it at the bench's trees (a changed heuristic cannot leave stale figures)."""
  import math

  from kernels.optim import pallas_triton_evidence as evidence

  e = evidence.launch_evidence([5000, 1, 0, 4096], 4, 3, MultiTensorBlocks(1024, 4096, 4))
  assert (e.leaves, e.params, e.programs) == (4, 9097, 2 + 1 + 1)
  assert e.registers_per_thread == 4 * 8 + 32 and e.resident_per_sm == 8  # 65536 / (64 * 128)
  assert e.bytes_per_program == 4096 * 7 * 4 and e.bytes_in_flight_per_sm == 8 * 1024 * 16
  assert e.ideal_bytes == 9097 * 28
  for tree in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
    sizes = [math.prod(s) for s in decoder_param_shapes(tree).values()]
    for rule, (n_in, n_out) in (("adamw", (4, 3)), ("lion/sgd", (3, 2))):
      e = evidence.launch_evidence(sizes, n_in, n_out)
      assert e.bytes_in_flight_per_sm >= 4 * e.needed_in_flight_per_sm
      row = evidence.table_row(tree, rule, n_in + n_out, e)
      assert row in evidence.__doc__, row


def test_bench_case_memory_donated_outputs_alias_inputs():
  """bench/kernels/cases/optim.py's memory figures at the tiny tree: donated, the in-place step and the
  reference write into their inputs (peak = the 4 input trees, no output buffers), and the case
  needs less than undonated (a state conversion that broke aliasing would give 7 trees)."""
  from bench.kernels.cases.optim import memory_need

  tree = 4 * sum(np.prod(s) for s in decoder_param_shapes("tiny").values()) / 2**30
  donated, kept = memory_need("tiny", "adamw", True), memory_need("tiny", "adamw", False)
  for side in ("kernel", "reference"):
    assert donated[f"{side}_peak"] == pytest.approx(4 * tree, rel=0.01)
    assert kept[f"{side}_peak"] == pytest.approx(7 * tree, rel=0.01)
  assert donated["case_need"] < kept["case_need"]


@settings(max_examples=10)  # each example compiles an interpreted 1-4 leaf launch (~2 s on 2 cores)
@given(
  sizes=st.lists(st.integers(0, 700), min_size=1, max_size=4),
  masters=st.lists(st.booleans(), min_size=4, max_size=4),
  decays=st.lists(st.booleans(), min_size=4, max_size=4),
  seed=st.integers(0, 2**32 - 1),
)
def test_one_launch_over_ragged_leaves_matches_reference_hypothesis(sizes, masters, decays, seed):
  """Several ragged leaves (empty ones too) in ONE launch, each with or without a bf16 param + f32
  master and with or without weight decay, against the XLA reference of each leaf's rule: a wrong
  program -> leaf boundary, a chunk offset off by a step, or one leaf's rule applied to another shows
  up here (small chunks: 2 steps of 128 per program)."""
  rng = np.random.default_rng(seed)
  rule = kernels.optim.AdamW(0.9, 0.99, 1e-8, 0.1)
  n = len(sizes)
  rules = [rule if d else rule.without_weight_decay() for d in decays[:n]]
  f32 = [jnp.asarray(rng.normal(size=(k,)), jnp.float32) for k in sizes]
  grads = [jnp.asarray(rng.normal(size=(k,)), jnp.float32) for k in sizes]
  slots = [
    (jnp.asarray(rng.normal(size=(k,)), jnp.float32), jnp.asarray(rng.random(k), jnp.float32))
    for k in sizes
  ]
  params = [p.astype(jnp.bfloat16) if m else p for p, m in zip(f32, masters)]
  master = [p if m else None for p, m in zip(f32, masters)]
  scalars = rule.scalars(1e-2, 3)
  blocks = MultiTensorBlocks(128, 256, 4)
  kernel = kernels.optim.KernelOptions("pallas", "gpu", True, blocks)
  xla = kernels.optim.KernelOptions("xla")
  run = lambda o: jax.jit(  # one compile per side, not one per eager op
    lambda p, g, s, m: kernels.optim.update_leaves(rules, p, g, s, scalars, masters=m, options=o)
  )(params, grads, slots, master)
  ours, ref = run(kernel), run(xla)
  for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
    assert a.param.dtype == params[i].dtype and (a.master is None) == (master[i] is None)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      scale = max(1.0, float(np.max(np.abs(np.asarray(y, np.float32)), initial=0.0)))
      assert_close(x, y, "optimizer", x.dtype, 1, f"leaf {i}", scale=scale)


def test_xla_cost_bytes_are_the_documented_ones():
  """XLA's cost analysis of the compiled AdamW step on CPU (our XLA path and optax): never below the
  7 x 4 B/param minimum, and the 40 B the evidence docstring quotes (a fusion change in XLA that
  makes the reference cheaper would make the docstring's argument stale)."""
  import math

  from kernels.optim import pallas_triton_evidence as evidence

  shapes = decoder_param_shapes("tiny")
  n = sum(math.prod(s) for s in shapes.values())
  tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  tx, step = kernels.fused_adamw_step(1e-3, impl="xla")
  ours = evidence.xla_bytes_per_param(step, (tree, tree, jax.eval_shape(tx.init, tree)), n, (0, 2))
  ref = optax.adamw(1e-3)
  theirs = evidence.xla_bytes_per_param(
    lambda p, g, s: _apply(ref, p, g, s), (tree, tree, jax.eval_shape(ref.init, tree)), n
  )
  for got in (ours, theirs):
    assert got >= 28 and round(got) == 40, got
  assert "moves 40 B per parameter for optax AdamW" in " ".join(evidence.__doc__.split())


# ------------------------------------------------------------------------------ tuned impl="auto"
TUNED = MultiTensorBlocks(2048, 8192, 8)


def _optim_entry(impl, blocks):
  from kernels import autotune

  row = dict(impl=impl, blocks=autotune.blocks_to_json(blocks), time_s=1e-3, ok=True)
  return dict(winner=dict(impl=impl, blocks=row["blocks"]), candidates=[row])


def test_tuned_optim_entry_changes_the_blocks_and_a_bad_one_falls_back():
  """impl="auto" / blocks=None take the cache's multi-tensor launch on the GPU (rowloop) family;
  tiles of the other family (a tiled target given MultiTensorBlocks), an unknown impl or unknown
  block fields leave the caller's arguments, with a warning. Catches the optimizer ignoring what
  bench.tune measured for it, or a stale cache crashing the training step."""
  from kernels import autotune
  from kernels.optim import OP

  gpu, tpu = backend.make_target("gpu", interpret=False), backend.make_target("tpu", False)
  shape = dict(rule="adamw", dtype="float32", params=1500)
  legal = lambda target: OP.check_tuned(target, shape)
  entry = _optim_entry("pallas", TUNED)
  assert autotune.apply_checked(OP, "auto", None, entry, legal(gpu)) == ("pallas", TUNED)
  given = kernels.optim.default_blocks()
  assert autotune.apply_checked(OP, "auto", given, entry, legal(gpu)) == ("auto", given)
  bad = [
    (entry, tpu, "not ElementwiseBlocks"),
    (_optim_entry("triton", None), gpu, "impl must be"),
    (dict(winner=dict(impl="pallas", blocks=dict(block=1024, lanes=2))), gpu, "fields of none"),
  ]
  for e, target, why in bad:
    with pytest.warns(UserWarning, match=why):
      assert autotune.apply_checked(OP, "auto", None, e, legal(target)) == ("auto", None)


def test_tuned_optim_cache_is_read_per_device_and_a_corrupt_file_ignored(tmp_path):
  """Through the cache file for this device kind: the entry is found by the same bucket the tuner
  writes (rule, dtype, total parameters); the CPU interpreter target never reads it; a truncated
  file falls back with a warning."""
  import json

  from kernels import autotune
  from kernels.optim import OP
  from kernels.optim.leaf import KernelOptions, tuned_options

  params = [jnp.zeros((40, 30)), jnp.zeros((300,))]
  shape = dict(rule="adamw", dtype="float32", params=1500)
  data = dict(schema=autotune.SCHEMA, entries={"optim": {}})
  data["entries"]["optim"][OP.bucket(shape)] = _optim_entry("pallas", TUNED)
  path = autotune.cache_path(autotune.device_kind(), tmp_path)
  path.write_text(json.dumps(data))
  gpu = backend.make_target("gpu", interpret=False)
  with autotune.use_cache_dir(tmp_path):
    got = autotune.from_cache(OP, "auto", None, shape, OP.check_tuned(gpu, shape))
    assert got == ("pallas", TUNED)
    options = KernelOptions()
    cpu = backend.make_target("cpu")
    rules = [kernels.optim.AdamW()] * 2
    assert tuned_options(options, cpu, rules, params) == options
  path.write_text(json.dumps(data)[:30])
  with autotune.use_cache_dir(tmp_path), pytest.warns(UserWarning, match="tuning cache"):
    assert autotune.from_cache(OP, "auto", None, shape) == ("auto", None)
