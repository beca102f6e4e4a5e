"""Every TPU kernel as a TPU generation runs it, executed in jax's TPU interpreter on this CPU.

Inside ``backend.use_target("tpu", interpret=False, generation=G)`` each op builds exactly what
libtpu compiles for G (tests/bench/tpu/test_compile.py compiles the same calls): blocks and rows from the
heuristics at the call's shape, the compiler params (grid semantics, VMEM limits), the paged
kernel's DMA unroll (64) and two-slot page ring, the optimizer's 3-slot pipelined walk and its core
split. ``pltpu.force_tpu_interpret_mode`` then runs those pallas_calls in the TPU interpreter: a DMA
lands only at its wait (``on_wait``: a wait on the wrong slot or semaphore reads stale data), a
race detector watches every access, and a ``parallel`` grid axis runs on two simulated cores.

Per kernel: values against the pure-JAX reference (tolerances: bench/tolerances.py), no race, and
where the grid's parallel axis has more than one step, both simulated cores used (read from the
interpreter's race state: the cores whose VMEM / SMEM it saw accessed; kernels.backend keeps that
read, private to jax, in one place and fails naming the jax versions if it moves). The interpreter
keeps the last kernel's state only, so a call that runs two kernels (statistics then backward) has
the first one's races caught from the report the detector prints ("RACE DETECTED"), and its cores
unchecked.

Shapes: the production ones (bench/shapes.py) reduced along tokens / batch, ragged against every
tile: grpo_loss at Qwen2.5's V = 151936 (bf16) with N = 44 tokens (not a multiple of any row count
or of the 4096-column backward tile); the fused head at Qwen2.5-3B's H = 2048, N = 300 (v4's
256-row tile and a tail) and V = 1700 (1100 on v4: the one reduction beyond tokens, past each
generation's vocabulary tile, 1536 on v5e / v6e, 256 on v4; the interpreter's time there is the
matmuls, up to 1.9 GFLOP per grid step); paged decode at decode-4k with 4 sequences of ragged lengths
(one empty, stale NaN / inf past each length); the optimizers on ragged leaves (0-d, 1-D, 3-D, bf16
with an f32 master). ``-m slow`` adds the thorough variant: every generation of the table at more
tokens, f32 logits.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import kernels
from bench.tolerances import assert_close
from kernels import backend
from kernels.fused_linear import default_blocks as fused_blocks
from kernels.fused_linear import reference as fl_reference
from kernels.fused_linear.pallas_blocks import fused_rows
from kernels.grpo_loss import pallas_blocks as grpo_blocks
from kernels.grpo_loss.pallas_blocks import default_blocks as loss_blocks
from kernels.optim import pallas_tpu as optim_pallas
from kernels.paged_attention import paged_attention_reference

GENERATIONS = ("v4", "v5e", "v6e")
THOROUGH = tuple(g for g in backend.TPU_GENERATIONS if g not in GENERATIONS)
INTERPRETER = dict(dma_execution_mode="on_wait", detect_races=True, num_cores_or_threads=2)
QWEN_V = 151936


@contextlib.contextmanager
def production(gen: str):
  """G's production target, every pallas_call in the TPU interpreter; yields the target."""
  params = pltpu.InterpretParams(**INTERPRETER)
  with backend.use_target("tpu", interpret=False, generation=gen), pltpu.force_tpu_interpret_mode(params):  # fmt: skip
    yield backend.resolve()


def run_checked(fn, capsys, parallel_steps: int):
  """fn()'s result, with the interpreter's verdict asserted: no race in any kernel fn ran (the
  printed reports) nor in the last one (the flag), both cores used when the last kernel's parallel
  grid axis has ``parallel_steps`` >= 2."""
  capsys.readouterr()
  out = jax.block_until_ready(fn())
  state = backend.tpu_interpret_races()
  printed = capsys.readouterr().out
  assert not state.found and "RACE DETECTED" not in printed, printed[-3000:]
  if parallel_steps >= 2:
    assert state.cores == {0, 1}, f"{parallel_steps} parallel steps ran on cores {set(state.cores)}"
  return out


def test_the_race_detector_is_read_and_sees_two_cores(capsys):
  """The verdict every test here asserts can fail: a kernel whose two parallel grid steps (one per
  simulated core) both write the same output block is reported as a race, through
  backend.tpu_interpret_races (the flag private to jax), with both cores seen."""

  def racy(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  with production("v6e") as target:
    call = pl.pallas_call(
      racy,
      grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),  # both steps: block 0
      out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
      compiler_params=backend.compiler_params(target, dimension_semantics=("parallel",)),
    )
    jax.block_until_ready(call(jnp.ones((16, 128), jnp.float32)))
  state = backend.tpu_interpret_races()
  assert state.found and state.cores == {0, 1}
  assert "RACE DETECTED" in capsys.readouterr().out


def _loss_inputs(b, t, v, dtype, seed):
  k = jax.random.split(jax.random.key(seed), 5)
  logits = (jax.random.normal(k[0], (b, t, v), jnp.float32) * 2.0).astype(dtype)
  ids = jax.random.randint(k[1], (b, t), 0, v, jnp.int32)
  mask = jax.random.bernoulli(k[2], 0.85, (b, t))
  adv = jax.random.normal(k[3], (b,), jnp.float32)
  old = jax.random.normal(k[4], (b, t), jnp.float32) * 0.1 - 8.0  # ratios near 1, some clipped
  return logits, ids, mask, adv, old


def _value_and_grad(ids, mask, adv, **opts):
  """impl -> (x -> ((loss, per-token log-probs), dloss / dx)): the log-probs compared as well (a
  loss whose ratios all clip carries no gradient, and its value then checks no log-prob)."""

  def loss(impl):
    def f(x):
      value, aux = kernels.grpo_loss(x, ids, mask, adv, impl=impl, **opts)
      return value, aux.per_token_logps

    return jax.value_and_grad(f, has_aux=True)

  return loss


def _loss_case(gen, capsys, b, t, v, dtype, level, edge_ids=False):
  """grpo_loss's gradient at G's production target against the reference: ``token`` is the
  training kernel (one kernel writes dlogits), ``sequence`` the statistics then backward kernels.
  ``edge_ids``: the first tokens' ids at the vocabulary's last column, the first column past the
  last whole 128-lane slab and the column before it (random ids miss a short tail)."""
  logits, ids, mask, adv, old = _loss_inputs(b, t, v, dtype, seed=b * t)
  if edge_ids:
    edge = jnp.asarray([v - 1, v // 128 * 128, v // 128 * 128 - 1], jnp.int32)
    ids = ids.at[0, :3].set(edge).at[-1, -3:].set(edge)
  loss = _value_and_grad(ids, mask, adv, old_logps=old, importance_sampling_level=level)
  return _compare_at_production(gen, capsys, loss, logits, level)


def _compare_at_production(gen, capsys, loss, logits, level):
  """loss (:func:`_value_and_grad`) at G's production target in the TPU interpreter against the
  reference: loss, per-token log-probs and dlogits. Returns the last kernel's parallel steps."""
  b, t, v = logits.shape
  n, dtype = b * t, logits.dtype
  with production(gen) as target:
    blocks = loss_blocks(target, n, v, dtype)
    if level == "token" and not blocks.vocab_tiled:  # the training kernel's [rows, V] blocks
      rows = grpo_blocks.stats_rows(blocks.block_n, n, v, dtype, target, blocks=2)
      steps = -(-n // rows)
    else:  # the backward kernel (last to run): (rows / block_n, V / block_v), both parallel
      steps = -(-n // blocks.block_n) * -(-v // blocks.block_v)
    (value, logps), grad = run_checked(lambda: loss("pallas")(logits), capsys, steps)
  (ref_value, ref_logps), ref_grad = loss("xla")(logits)
  assert float(jnp.max(jnp.abs(ref_grad))) > 0, "a case whose gradient is 0 checks no backward"
  assert_close(value, ref_value, "value", jnp.float32, n * v, "loss")
  assert_close(logps, ref_logps, "value", jnp.float32, v, "per-token log-probs")
  assert_close(grad, ref_grad, "grad", dtype, v, "dlogits")
  return steps


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("gen", GENERATIONS)
def test_grpo_loss_kernels(gen, level, capsys):
  """Catches: a training-kernel row block that the production rows make ragged (the last block's
  rows past N written or read as real), a chosen column patched in the wrong 128-lane window, a
  backward tile past V not masked, a parallel axis split over cores that drops or repeats a block,
  a race between a core's output block and its neighbour's."""
  steps = _loss_case(gen, capsys, 4, 11, QWEN_V, jnp.bfloat16, level)
  assert steps >= 2  # the shape must put both cores to work


def test_grpo_loss_ragged_vocabulary(capsys):
  """V = 1100 (8 whole 128-lane slabs and a 76-column tail) on v6e's training kernel. Catches: a
  chosen column in the tail read from the wrong window or from both (its logit counted twice), a
  chosen column just below the tail taken from the tail window, the tail's columns past V swept
  (the form that Mosaic refused to compile before: a dynamic unaligned window, E2003)."""
  _loss_case("v6e", capsys, 2, 5, 1100, jnp.bfloat16, "token", edge_ids=True)


# issue 52's v4 targets (N = 4096): whole [rows, V] blocks outgrow v4's 16 MiB of VMEM
V4_LARGE_VOCAB = ((128256, "float32"), (151936, "float32"), (262144, "bfloat16"))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_loss_vocab_tiled_on_v4(level, capsys):
  """f32 logits at Qwen's V on v4 (N reduced to 18 tokens: 2 row blocks of 16, 10 vocabulary tiles
  of 16384, the last ragged): the heuristic tiles the vocabulary, as at the production shapes
  (and keeps whole rows where they fit). Catches: the running max / sums not carried across the
  vocabulary axis (reset per tile, or a tile folded twice), the last tile's columns past V read
  as logits, a row block's statistics written before its last tile, the training path's
  coefficient or backward fed the wrong saved statistics."""
  with production("v4") as target:
    for v, dtype in V4_LARGE_VOCAB:
      assert loss_blocks(target, 4096, v, dtype).vocab_tiled, (v, dtype)
    assert not loss_blocks(target, 4096, QWEN_V, "bfloat16").vocab_tiled  # whole rows fit
    assert loss_blocks(target, 18, QWEN_V, "float32").vocab_tiled
  with production("v6e") as target:
    assert not any(loss_blocks(target, 4096, v, d).vocab_tiled for v, d in V4_LARGE_VOCAB)
  steps = _loss_case("v4", capsys, 2, 9, QWEN_V, jnp.float32, level)
  assert steps >= 2


def test_grpo_loss_vocab_tiled_bf16_on_v4(capsys):
  """bf16 logits at Gemma's V = 262144 on v4 (10 tokens: one ragged row block, 4 vocabulary tiles
  of 65536), the one-sweep statistics and the backward in their unpacked form (each window converted
  to f32 before it is split into slabs: v4 has no bf16 VPU). Catches: a slab of the converted window
  taken from the wrong columns (one counted twice, another dropped), a backward slab's chosen column
  (the onehot) placed at the wrong tile or slab offset."""
  with production("v4") as target:
    assert loss_blocks(target, 9, 262144, jnp.bfloat16).vocab_tiled
  assert _loss_case("v4", capsys, 2, 5, 262144, jnp.bfloat16, "sequence") >= 2


def test_grpo_loss_vocab_tiled_fallback_on_v4(capsys):
  """v4's vocab-tiled forward where one token's logits hold one 120 nats above its chosen one's
  (f32 at Qwen's V, 9 tokens): the one-sweep kernel's sums overflow, it flags the row, and the exact
  two-sweep kernel reruns; both at v4's production target. Catches: the flag not raised or not
  read (that token's log-prob -inf instead of about -120), the exact kernel's sweeps wrong at v4's
  tiles (it runs nowhere else in CI), the other tokens' values taken from the wrong kernel."""
  logits, ids, mask, adv, old = _loss_inputs(1, 9, QWEN_V, jnp.float32, seed=5)
  far = (ids[0, 4] + 7) % QWEN_V
  logits = logits.at[0, 4, far].set(logits[0, 4, ids[0, 4]] + 120.0)
  logps = lambda impl: kernels.grpo_loss(logits, ids, mask, adv, old_logps=old, impl=impl)[1]
  with production("v4") as target:
    assert loss_blocks(target, 9, QWEN_V, jnp.float32).vocab_tiled
    ours = run_checked(lambda: logps("pallas").per_token_logps, capsys, 1)
  ref = logps("xla").per_token_logps
  assert float(ref[0, 4]) < -100.0
  assert_close(ours, ref, "value", jnp.float32, QWEN_V, "per-token log-probs")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("gen", GENERATIONS + THOROUGH)
def test_grpo_loss_kernels_thorough(gen, level, dtype, capsys):
  """The thorough variant (by hand: -m slow): every generation, f32 logits too, 150 tokens (more
  than a backward row tile). Generations whose VMEM cannot hold the f32 row blocks at this V are
  refused by grpo_loss before anything runs, with the reason."""
  try:
    _loss_case(gen, capsys, 6, 25, QWEN_V, dtype, level)
  except ValueError as e:
    pytest.skip(f"grpo_loss refuses it on {gen}: {e}")


def _fused_inputs(n, h, v, seed):
  k = jax.random.split(jax.random.key(seed), 5)
  hidden = jax.random.normal(k[0], (1, n, h), jnp.float32).astype(jnp.bfloat16)
  head = (jax.random.normal(k[1], (h, v), jnp.float32) * 2.0 / h**0.5).astype(jnp.bfloat16)
  ids = jax.random.randint(k[2], (1, n), 0, v, jnp.int32)
  mask = jax.random.bernoulli(k[3], 0.9, (1, n))
  return hidden, head, ids, mask, jax.random.normal(k[4], (1,), jnp.float32)


@pytest.mark.parametrize("gen", GENERATIONS)
def test_fused_head_kernels(gen, capsys):
  """The statistics kernel, then the gradients at H = 2048: on v5e / v6e the one gradient kernel
  (dh resident in VMEM, DMA'd out at the last step), on v4 (megacore) the dhidden and dweight
  kernels. Catches: the weight tile's columns past V (DMA garbage) reaching dl @ w^T, tail rows past
  N accumulated, an accumulator not reset at a new output block, the dh DMA racing the last step's
  accumulation, the dweight grid's parallel vocabulary axis split over cores wrongly (v4)."""
  n, h, v = 300, 2048, 1100 if gen == "v4" else 1700  # past each generation's vocabulary tile
  hidden, head, ids, mask, adv = _fused_inputs(n, h, v, seed=len(gen))

  def loss(impl):
    f = lambda x, w: kernels.fused_linear_grpo_loss(x, w, ids, mask, adv, impl=impl)[0]
    return jax.value_and_grad(f, argnums=(0, 1))

  with production(gen) as target:
    blocks = fused_blocks(target, n, h, v)
    assert v > blocks.block_v and v % blocks.block_v, blocks  # a whole tile and a ragged tail
    one_kernel = fused_rows(blocks, n, h, 2, target) > 0  # its grid has no parallel axis
    steps = 1 if one_kernel else -(-v // blocks.block_v)  # the last kernel's parallel axis
    value, (dh, dw) = run_checked(lambda: loss("pallas")(hidden, head), capsys, steps)
  ref = fl_reference.fused_linear_grpo_loss_reference
  f = lambda x, w: ref(x, w, ids, mask, adv)[0]
  ref_value, (ref_dh, ref_dw) = jax.value_and_grad(f, argnums=(0, 1))(hidden, head)
  assert one_kernel == (gen != "v4") and (one_kernel or steps >= 2)
  assert_close(value, ref_value, "value", jnp.float32, n * v, "loss")
  assert_close(dh, ref_dh, "grad", jnp.bfloat16, v, "dhidden")
  assert_close(dw, ref_dw, "grad", jnp.bfloat16, n, "dweight")


def _paged_inputs(b, hq, hkv, d, ctx, page, seed):
  rng = np.random.default_rng(seed)
  pps = ctx // page
  npages = b * pps + 5
  k = rng.standard_normal((hkv, npages, page, d)).astype(np.float32)
  v = rng.standard_normal((hkv, npages, page, d)).astype(np.float32)
  lengths = np.array([ctx, 0, 1500, 3077][:b], np.int32)  # full, idle, ragged vs every block
  table = rng.permutation(npages)[: b * pps].reshape(b, pps).astype(np.int32)
  for bi in range(b):  # a recycled page's stale content in every slot past the length
    for t in range(lengths[bi], pps * page):
      k[:, table[bi, t // page], t % page] = np.nan
      v[:, table[bi, t // page], t % page] = np.inf
  q = rng.standard_normal((b, hq, d)).astype(np.float32)
  cast = lambda a: jnp.asarray(a, jnp.bfloat16)
  return cast(q), cast(k), cast(v), jnp.asarray(lengths), jnp.asarray(table)


@pytest.mark.parametrize("gen", GENERATIONS)
def test_paged_decode_kernel(gen, capsys):
  """decode-4k's layer (16 query / 2 kv heads of 128, pages of 16) for 4 sequences. Catches: a page
  DMA waited on the wrong slot or semaphore (on-wait DMAs: stale data), the next sequence's first
  block prefetched into the slot still being read, stale NaN / inf past a length reaching the
  output, the core axis dropping a sequence."""
  q, k, v, lengths, table = _paged_inputs(4, 16, 2, 128, 4096, 16, seed=3)
  with production(gen):
    out = run_checked(
      lambda: kernels.paged_attention(q, k, v, lengths, table, impl="pallas"), capsys, 2
    )  # the kernel's core axis: 2 for an even batch
  ref = paged_attention_reference(q, k, v, lengths, table, scale=128**-0.5)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert_close(out, ref, "attention", jnp.bfloat16, 4096)


OPTIMIZERS = {"adamw": kernels.fused_adamw_step, "lion": kernels.fused_lion_step,
              "sgd": kernels.fused_sgd_step}  # fmt: skip
LEAVES = {"embed": (1100, 1300), "w": (37, 24), "wide": (3, 700), "bias": (300,), "scale": (),
          "conv": (5, 7, 3), "norm": (384,)}  # fmt: skip


def _tree(seed):
  rng = np.random.default_rng(seed)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in LEAVES.items()}
  params["w"] = params["w"].astype(jnp.bfloat16)  # a bf16 leaf (its update rounds once)
  grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32).astype(p.dtype)
           for (k, s), p in zip(LEAVES.items(), params.values())}  # fmt: skip
  return params, grads


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("gen", GENERATIONS)
def test_optimizer_pipelined_walk(gen, name, capsys):
  """The in-place step over a ragged tree, at the generation's VMEM windows and core
  split (two cores on megacore v4; one on v5e / v6e, where the second simulated core has no grid
  step to run). Catches: a slot refilled before its stores were waited for, an update before its
  loads landed, a window off by a row or past a leaf's edge, a core split dropping an item."""
  params, grads = _tree(seed=len(name))

  def one_step(impl):
    tx, step = OPTIMIZERS[name](1e-2, impl=impl)
    return step(params, grads, tx.init(params))[0]

  with production(gen) as target:
    cores = optim_pallas.cores_of(target)
    out = run_checked(lambda: one_step("pallas"), capsys, cores)
  ref = one_step("xla")
  for k in LEAVES:
    scale = max(1.0, float(jnp.max(jnp.abs(ref[k].astype(jnp.float32)), initial=0.0)))
    assert out[k].dtype == ref[k].dtype
    assert_close(out[k], ref[k], "optimizer", out[k].dtype, 1, f"{name} {k}", scale=scale)


def test_fused_head_kernels_with_support_gaps(capsys):
  """v6e's production statistics and one gradient kernel with each row's support threshold as an
  input (issue 48): ids among each row's top 3, a top-4 set cut at the midpoint of two logits for
  two thirds of the rows. Catches: the threshold block read at another row offset than the ids',
  y dropped from its own set in a tile, the gradient kernel scoring over the full softmax."""
  n, h, v = 100, 2048, 1700
  hidden, head, _, mask, adv = _fused_inputs(n, h, v, seed=11)
  z = np.asarray(fl_reference.linear_logits(hidden, head), np.float32)[0]
  order, zs = np.argsort(-z, 1), -np.sort(-z, 1)
  rows = np.arange(n)
  ids = order[rows, rows % 3]
  gap = (zs[:, 3] + zs[:, 4]) / 2 - z[rows, ids]
  gap = np.where((rows % 3 == 2) | (zs[:, 3] - zs[:, 4] < 0.02), -np.inf, gap)
  ids, gap = jnp.asarray(ids[None], jnp.int32), jnp.asarray(gap[None], jnp.float32)

  def loss(impl):
    f = lambda x, w: kernels.fused_linear_grpo_loss(x, w, ids, mask, adv, support_gap=gap, impl=impl)  # fmt: skip
    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)

  with production("v6e"):
    (value, aux), (dh, dw) = run_checked(lambda: loss("pallas")(hidden, head), capsys, 1)
  (ref_value, ref_aux), (ref_dh, ref_dw) = loss("xla")(hidden, head)
  assert_close(value, ref_value, "value", jnp.float32, n * v, "loss")
  assert_close(aux.per_token_logps, ref_aux.per_token_logps, "value", jnp.float32, h + v, "logp")
  full = z[rows, ids[0]] - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) - z.max(1)
  cut = np.isfinite(np.asarray(gap[0])) & np.asarray(mask[0])
  assert np.mean(np.asarray(ref_aux.per_token_logps[0])[cut] - full[cut]) > 0.5  # S: 4 columns
  assert_close(dh, ref_dh, "grad", jnp.bfloat16, v, "dhidden")
  assert_close(dw, ref_dw, "grad", jnp.bfloat16, n, "dweight")


def _gapped_loss_case(gen, capsys, b, t, v, dtype, level):
  """:func:`_loss_case` with support gaps (issue 48: the kernels gap their own sweeps): the
  engines' midpoint gaps of a top-k filter, a third unfiltered. Returns the parallel steps."""
  from tests.kernels.grpo_loss.test_support_gap import top_k_gaps

  logits, ids, mask, adv, old = _loss_inputs(b, t, v, dtype, seed=b * t + 1)
  gap = top_k_gaps(logits, ids, 1.0, seed=b * t)
  opts = dict(old_logps=old, importance_sampling_level=level, support_gap=gap)
  return _compare_at_production(gen, capsys, _value_and_grad(ids, mask, adv, **opts), logits, level)


def test_grpo_loss_gapped_training_kernel(capsys):
  """The training kernel with gaps at v6e's production target (the slab form: 128-lane slabs, the
  gapped 2x unrolled loop, a ragged 1100-column vocabulary's tail). Catches: a slab or the tail
  gapped with another row group's thresholds, the gap dropped from the dlogits sweep."""
  assert _gapped_loss_case("v6e", capsys, 2, 9, 1100, jnp.bfloat16, "token") >= 2


@pytest.mark.slow  # ~20 s of CPU; the CPU interpreter's vocab_tiled family runs its gapped tiles
def test_grpo_loss_gapped_vocab_tiled(capsys):
  """v4's vocab-tiled statistics and the backward kernel with gaps (f32 at Qwen's V: 10 tiles of 9 rows, the
  last ragged). Catches: a tile's exponentials not gapped, the backward's tiles gapped with the
  wrong rows' thresholds."""
  assert _gapped_loss_case("v4", capsys, 1, 9, QWEN_V, jnp.float32, "sequence") >= 2
