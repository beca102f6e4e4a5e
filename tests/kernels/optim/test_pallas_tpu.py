"""The TPU (tiled) optimizer launch: its plan (kernels.optim.pallas_tpu_plan), its pipelined walk in the TPU
interpreter (on-wait DMAs over two cores), and libtpu's compile of the step — one Mosaic launch for
the tree, bytes within 1.3x of the 7 / 5 words per parameter, no relayout copy — alone and inside
the FSDP shard_map (the compile tests skip without libtpu: nox -s tpu_compile has it)."""

import math
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import kernels
from bench.shapes import decoder_param_shapes
from bench.tolerances import assert_close
from kernels import backend, tpu_targets
from kernels.optim import ElementwiseBlocks, leaf
from kernels.optim import pallas_tpu as pallas
from kernels.optim import pallas_tpu_plan as tiles
from kernels.optim.reference import elementwise_reference

F32, BF16 = np.dtype("float32"), np.dtype(jnp.bfloat16)
ADAMW = (F32,) * 4, (F32,) * 3  # (inputs, outputs) of the f32 in-place AdamW step


def _spec(shape, dtypes=ADAMW, key=0):
  return tiles.LeafSpec(pallas._operand_shape(shape), *dtypes, key)


def _covered(plan: tiles.Plan, specs) -> list[np.ndarray]:
  """How many windows cover each element of each leaf's view."""
  hits = [np.zeros(s.view, np.int32) for s in specs]
  for seg in plan.segments:
    for j in range(seg.count):
      l, r, c = tiles.item_window(seg, j)
      _, h, w = seg.window
      hits[seg.leaf][l, r : r + h, c : c + w] += 1
  return hits


@given(
  shapes=st.lists(st.lists(st.integers(1, 300), min_size=0, max_size=3), min_size=1, max_size=5),
  bf16=st.lists(st.booleans(), min_size=5, max_size=5),
  elems=st.sampled_from([1024, 4096, 1 << 15]),
)
def test_plan_windows_cover_every_element_once_hypothesis(shapes, bf16, elems):
  """Every element of every leaf in exactly one window, windows within their class buffers, a
  ragged (non-128) width only as a buffer's whole width, and item ids contiguous: a window step
  off by a row, a dropped ragged edge or two leaves' windows overlapping show up here."""
  specs = [
    _spec(tuple(s), ((BF16, F32, F32, F32), (BF16, F32, F32, F32)) if b else ADAMW)
    for s, b in zip(shapes, bf16)
  ]
  plan = tiles.make_plan(specs, vmem_budget=1 << 30, cores=2, tile_elems=elems)
  for hit in _covered(plan, specs):
    assert hit.min() == 1 and hit.max() == 1
  start = 0
  for seg in plan.segments:
    assert seg.start == start
    start += seg.count
    cls = plan.classes[seg.cls]
    assert seg.window[1] <= cls.tile[0] and seg.window[2] == cls.tile[1]
    # a buffer row count off the sublane tile only as a class's exact rows (a ragged window is
    # never a prefix of a taller buffer: Mosaic slices rows at whole tiles only)
    assert cls.tile[0] % cls.sub == 0 or seg.window[1] == cls.tile[0]
    if seg.window[1] % cls.sub:
      assert seg.window[1] == cls.tile[0], (seg.window, cls.tile)
  assert plan.items == start and plan.splits[0] == 0 and plan.splits[-1] == start


@pytest.mark.parametrize("tree", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_plan_fits_every_generation_and_splits_megacore_bytes_evenly(tree):
  """At the production trees, every generation's buffers fit 3/4 of its VMEM (v4: 12 of 16 MiB),
  every leaf is one segment or a few (no per-row explosion of branches), and the two TensorCores
  of a megacore part get equal bytes to within one item."""
  specs = [_spec(s) for s in decoder_param_shapes(tree).values()]
  for gen in tpu_targets.GENERATIONS:
    target = backend.make_target("tpu", False, gen)
    plan = tiles.make_plan(specs, vmem_budget=target.vmem_bytes * 3 // 4, cores=2)
    assert plan.vmem_bytes() <= target.vmem_bytes * 3 // 4, gen
    assert len(plan.segments) <= 2 * len(specs) and len(plan.classes) <= 6, gen
    per_item = [
      math.prod(s.window) * 28 for s in plan.segments for _ in range(s.count)
    ]  # AdamW f32: 7 words
    halves = [sum(per_item[a:b]) for a, b in zip(plan.splits, plan.splits[1:])]
    assert abs(halves[0] - halves[1]) <= max(per_item), gen


def test_plan_too_large_for_vmem_names_the_budget():
  with pytest.raises(ValueError, match="over the budget of 1000"):
    tiles.make_plan([_spec((64, 128))], vmem_budget=1000)


def _ragged_works(seed=0):
  """AdamW leaves of every kind the walk distinguishes: a ragged matrix, a wide one split in column
  windows, 1-D leaves (handed over as [1, 300] and [3, 128]), a scalar, a 3-D leaf with rows off
  the tile, a bf16 param with an f32 master, with and without weight decay."""
  rng = np.random.default_rng(seed)
  rule = kernels.optim.AdamW(0.9, 0.99, 1e-8, 0.1)
  works = []
  for i, shape in enumerate([(37, 24), (3, 700), (300,), (), (5, 7, 3), (384,)]):
    p, g, mu = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3))
    r = rule if i % 2 else rule.without_weight_decay()
    param, master = (p.astype(jnp.bfloat16), p) if i == 2 else (p, None)
    works.append(leaf._leaf_work(r, param, g, (mu, jnp.abs(mu)), master, "param")[0])
  return works, rule.scalars(1e-2, 3)


def test_pipelined_walk_in_tpu_interpreter_matches_reference():
  """The TPU kernel's own pipeline (3 slots, loads of item k + 1 and stores of item k - 1 in flight
  while item k is updated) in the TPU interpreter with on-wait DMAs — a copy lands only when waited
  for — over two cores: a slot refilled before its stores were waited for, an update before its
  loads, or a core split dropping an item gives wrong values here (the plain interpreter copies at
  start and cannot tell). Built for v4 (megacore: the parallel core axis and its compiler params,
  as compiled), races asserted absent and both simulated cores used."""
  pltpu = backend._tpu_module()
  works, scalars = _ragged_works()
  params = pltpu.InterpretParams(
    dma_execution_mode="on_wait", detect_races=True, num_cores_or_threads=2
  )
  outs = pallas.multi_tensor_call(
    works,
    jnp.stack(scalars),
    target=backend.make_target("tpu", interpret=False, generation="v4"),
    blocks=ElementwiseBlocks(16, 256),  # ragged windows in rows and columns, ~16 items
    in_place=True,
    interpret=params,
    cores=2,
  )
  jax.block_until_ready(outs)  # the interpreter's state is read after the kernel ran
  races = backend.tpu_interpret_races()
  assert not races.found and races.cores == {0, 1}
  for i, (w, out) in enumerate(zip(works, outs)):
    ref = elementwise_reference(w.body, w.inputs, w.outputs, scalars)
    for k in w.outputs:
      assert out[k].dtype == ref[k].dtype
      scale = max(1.0, float(jnp.max(jnp.abs(ref[k].astype(jnp.float32)), initial=0.0)))
      assert_close(out[k], ref[k], "optimizer", out[k].dtype, 1, f"leaf {i} {k}", scale=scale)


# --------------------------------------------------------------------------- libtpu compiles
needs_libtpu = pytest.mark.skipif(
  not tpu_targets.libtpu_available(), reason="needs libtpu (nox -s tpu_compile)"
)
MAKE = {"adamw": kernels.fused_adamw_step, "lion": kernels.fused_lion_step, "sgd": kernels.fused_sgd_step}  # fmt: skip
WORDS = {"adamw": 7, "lion": 5, "sgd": 5}  # f32 words read + written per parameter, at least


def _reduced_0_5b() -> dict[str, tuple[int, ...]]:
  """Every leaf kind of the Qwen2.5-0.5B tree at its real shape (embedding, layer 0's 12 tensors,
  the final norm): the compile cost is per leaf, not per byte."""
  shapes = decoder_param_shapes("qwen2.5-0.5b")
  return {k: s for k, s in shapes.items() if not k.startswith("layers.") or ".0." in k}


def _relayouts(hlo: str) -> list[str]:
  """Copies, transposes and reshapes of arrays (not scalars) in compiled HLO: a relayout of a leaf
  costs 2 words per element (bitcasts are free and not listed)."""
  out = []
  for line in hlo.splitlines():
    m = re.match(r"\s*%\S+ = \w+\[([\d,]*)\]\S* (copy|copy-start|transpose|reshape)\(", line)
    if m and math.prod(int(d) for d in m.group(1).split(",") if d) > 1:
      out.append(line.strip()[:160])
  return out


def _compiled_step(gen: str, shapes, which: str, fsdp: int = 0):
  """(launches, bytes accessed per device, ideal bytes per device, relayouts) of the donated
  in-place step compiled by libtpu for ``gen`` (one device, or an fsdp mesh of ``fsdp``)."""
  if fsdp:
    mesh = Mesh(np.array(backend.tpu_devices(f"{gen}-{fsdp}")), ("fsdp",))
    spec = lambda s: P("fsdp") if s and s[0] % fsdp == 0 else P()
    sharding = lambda s: NamedSharding(mesh, spec(s))
    kw = dict(mesh=mesh, partition_specs={k: spec(s) for k, s in shapes.items()})
  else:
    dev = backend.tpu_devices(backend.TpuSlice.parse(gen).name)[0]
    sharding, kw = (lambda s: SingleDeviceSharding(dev)), {}
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x.shape))
  tree = {k: place(jax.ShapeDtypeStruct(s, jnp.float32)) for k, s in shapes.items()}
  with backend.use_target("tpu", interpret=False, generation=gen):
    tx, step = MAKE[which](1e-3, impl="pallas", **kw)
    state = jax.tree.map(place, jax.eval_shape(tx.init, tree))
    compiled = jax.jit(step, donate_argnums=(0, 2)).trace(tree, tree, state).lower().compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  hlo = compiled.as_text()
  ideal = WORDS[which] * 4 * sum(math.prod(s) for s in shapes.values()) / max(fsdp, 1)
  return hlo.count("tpu_custom_call"), cost["bytes accessed"], ideal, _relayouts(hlo)


@needs_libtpu
@pytest.mark.parametrize("gen", ["v6e", "v4"])
def test_tpu_step_is_one_launch_at_ideal_bytes_for_0_5b_leaf_kinds(gen):
  """libtpu compiles the AdamW step over every 0.5B leaf kind (real shapes) to ONE Mosaic launch,
  XLA's bytes within 1.3x of 7 words per parameter, and no relayout of any leaf: a per-leaf launch
  or a flat [n / 2048, 2048] view (the previous kernel: 290 launches, 4.2x) fails here."""
  launches, nbytes, ideal, relayouts = _compiled_step(gen, _reduced_0_5b(), "adamw")
  assert launches == 1
  assert ideal <= nbytes <= 1.3 * ideal, nbytes / ideal
  assert not relayouts, relayouts


# The loop's stacked tree (rl.model: one leaf per kind, layers stacked on a leading axis) at the
# 1.5B config's 28 layers: [28, 1536] norms are row counts off the 8-row sublane tile.
STACKED_1_5B = {
  "embed": (151936, 1536),
  "final_norm": (1536,),
  "layers.input_norm": (28, 1536),
  "layers.k_bias": (28, 256),
  "layers.q": (28, 1536, 1536),
  "layers.down": (28, 8960, 1536),
}


@needs_libtpu
@pytest.mark.parametrize("gen", ["v6e", "v4"])
def test_tpu_step_on_the_loops_stacked_tree_with_ragged_layer_count(gen):
  """Catches: a window of 28 rows sliced out of a shared 64-row f32 buffer, which Mosaic rejects
  ("Slice sizes along tiled dimensions must be aligned to tiles"): the 1.5B config's train step did
  not compile until ragged row counts got buffers of their own rows (kernels.optim.pallas_tpu_plan._plan)."""
  launches, nbytes, ideal, relayouts = _compiled_step(gen, STACKED_1_5B, "adamw")
  assert launches == 1
  assert ideal <= nbytes <= 1.3 * ideal, nbytes / ideal
  assert not relayouts, relayouts


@needs_libtpu
def test_tpu_step_inside_fsdp_shard_map_on_v6e_4():
  """The same step with each leaf's rows sharded over a 4-chip fsdp mesh (v6e-4): one launch per
  device, a quarter of the bytes, no relayout and no collective (each chip walks its own shards)."""
  launches, nbytes, ideal, relayouts = _compiled_step("v6e", _reduced_0_5b(), "adamw", fsdp=4)
  assert launches == 1
  assert ideal <= nbytes <= 1.3 * ideal, nbytes / ideal
  assert not relayouts, relayouts


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen,which", [("v6e", "adamw"), ("v4", "sgd")])
def test_tpu_step_at_the_full_0_5b_tree(gen, which):
  """The whole Qwen2.5-0.5B tree (290 leaves): one launch, bytes within 1.3x of the ideal (AdamW 7,
  SGD 5 words per parameter); ~45-75 s of compile each on 2 cores. Both generations and both word
  counts here; Lion is compiled over the 0.5B tree's leaf kinds on every generation in
  tests/bench/tpu/test_compile.py (bench.tpu.compile's optim cases)."""
  launches, nbytes, ideal, relayouts = _compiled_step(
    gen, decoder_param_shapes("qwen2.5-0.5b"), which
  )
  assert launches == 1
  assert ideal <= nbytes <= 1.3 * ideal, nbytes / ideal
  assert not relayouts, relayouts
