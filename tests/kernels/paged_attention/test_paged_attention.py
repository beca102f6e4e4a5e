"""paged_attention: the reference against hand-computed values, both Pallas families (tiled = TPU
kernel, rowloop = GPU kernel, each in the interpreter) against the reference, and bad input."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import kernels
from bench.kernels.cases.paged_attention import make_inputs
from bench.shapes import PAGED_SHAPES, PRODUCTION_PAGED_SHAPES
from bench.tolerances import assert_close
from kernels.backend import Target
from kernels.paged_attention import PagedBlocks, default_blocks, plan
from kernels.paged_attention.reference import combine_splits

FAMILIES = {
  "tiled": "cpu",
  "rowloop": "gpu",
}  # platform whose kernel family runs in the interpreter


def test_reference_by_hand():
  # One sequence, one head, D = 1, page_size 1, pages [2, 0]; scores = q*k = [0, ln 3] -> p = [1/4, 3/4].
  q = jnp.array([[[1.0]]])
  k_pages = jnp.array([[[[np.log(3.0)]], [[9.0]], [[0.0]]]])  # [Hkv=1, P=3, 1, 1]; page 1 is unused
  v_pages = jnp.array([[[[8.0]], [[100.0]], [[4.0]]]])
  page_indices = jnp.array([[2, 0]], jnp.int32)
  out = kernels.paged_attention_reference(
    q, k_pages, v_pages, jnp.array([2], jnp.int32), page_indices, scale=1.0
  )
  np.testing.assert_allclose(out, [[[0.25 * 4.0 + 0.75 * 8.0]]], rtol=1e-6)
  # length 1: only the first page's token; length 0: zeros, not NaN
  one = kernels.paged_attention_reference(
    q, k_pages, v_pages, jnp.array([1], jnp.int32), page_indices
  )
  np.testing.assert_allclose(one, [[[4.0]]])
  zero = kernels.paged_attention_reference(
    q, k_pages, v_pages, jnp.array([0], jnp.int32), page_indices
  )
  np.testing.assert_array_equal(zero, [[[0.0]]])


def test_combine_splits_is_exact():
  rng = np.random.default_rng(0)
  s = jnp.asarray(rng.standard_normal((2, 6)), jnp.float32)  # 2 rows, 6 scores, split 4 + 2
  v = jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)
  full = jax.nn.softmax(s, -1) @ v
  parts, lses = [], []
  for sl in (slice(0, 4), slice(4, 6)):
    parts.append(jax.nn.softmax(s[:, sl], -1) @ v[sl])
    lses.append(jax.nn.logsumexp(s[:, sl], -1))
  empty_o, empty_lse = (
    jnp.zeros_like(parts[0]),
    jnp.full_like(lses[0], -jnp.inf),
  )  # a split past the end
  o = jnp.stack(parts + [empty_o])[:, None, None]  # [S, B=1, Hkv=1, G=2, D]
  lse = jnp.stack(lses + [empty_lse])[:, None, None]
  np.testing.assert_allclose(combine_splits(o, lse)[0, 0], full, rtol=1e-6, atol=1e-6)


def _draw(rng, b, hq, hkv, d, page_size, pps, lengths, dtype, spare_pages=3):
  pool = b * pps + spare_pages
  q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32).astype(dtype)
  k = jnp.asarray(rng.standard_normal((hkv, pool, page_size, d)), jnp.float32).astype(dtype)
  v = jnp.asarray(rng.standard_normal((hkv, pool, page_size, d)), jnp.float32).astype(dtype)
  pages = jnp.asarray(rng.permutation(pool)[: b * pps].reshape(b, pps), jnp.int32)
  return q, k, v, jnp.asarray(lengths, jnp.int32), pages


def _check(family, args, blocks=None, dtype=jnp.float32, ctx=None):
  ref = kernels.paged_attention(*args, impl="xla")
  out = kernels.paged_attention(
    *args, impl="pallas", platform=FAMILIES[family], interpret=True, blocks=blocks
  )
  assert out.shape == ref.shape and out.dtype == ref.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert_close(
    out,
    ref,
    "attention",
    dtype,
    ctx or args[4].shape[1] * args[1].shape[2],
    err_msg=f"{family} {blocks}",
  )
  return out


# page_size 8, 5 pages per sequence (40 tokens). With 2 pages per block (16-token blocks): 13 ends
# inside the first block's second page, 17 one token into the second block, 37 inside the third (last,
# partial) block, 23 mid-page in the second block: none is a multiple of the page or the block.
TINY_LENGTHS = [[0, 13, 37], [1, 17, 40], [23, 9, 31]]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("blocks", [None, PagedBlocks(2, 1), PagedBlocks(2, 2), PagedBlocks(4, 1)])
def test_parity_tiny_shape(family, dtype, blocks):
  s = PAGED_SHAPES["tiny"]
  rng = np.random.default_rng(1)
  for lengths in TINY_LENGTHS:
    args = _draw(
      rng, s.batch, s.q_heads, s.kv_heads, s.head_dim, s.page_size, s.pages_per_seq, lengths, dtype
    )
    out = _check(family, args, blocks, dtype=dtype)
    if lengths[0] == 0:
      np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0 -> zeros


@pytest.mark.parametrize("family", list(FAMILIES))
@given(
  data=st.data(),
  b=st.integers(1, 4),
  hkv=st.sampled_from([1, 2]),
  group=st.sampled_from([1, 2, 3, 4]),
  d=st.sampled_from([16, 32]),
  page_size=st.sampled_from([4, 8, 16]),
  pps=st.integers(1, 6),
  ppb=st.sampled_from([1, 2, 4]),
  splits=st.sampled_from([1, 2, 3]),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  seed=st.integers(0, 2**31 - 1),
)
def test_parity_hypothesis(
  family, data, b, hkv, group, d, page_size, pps, ppb, splits, dtype, seed
):
  if family == "rowloop" and ppb * page_size < 16:
    ppb = 16 // page_size  # Triton's dot minimum; blocks.check rejects smaller tiles (tested below)
  cap = pps * page_size
  lengths = data.draw(st.lists(st.integers(0, cap), min_size=b, max_size=b), label="lengths")
  args = _draw(np.random.default_rng(seed), b, group * hkv, hkv, d, page_size, pps, lengths, dtype)
  _check(family, args, PagedBlocks(ppb, splits), dtype)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_k_and_default_blocks_agree(family):
  s = PAGED_SHAPES["tiny"]
  rng = np.random.default_rng(2)
  args = _draw(
    rng,
    s.batch,
    s.q_heads,
    s.kv_heads,
    s.head_dim,
    s.page_size,
    s.pages_per_seq,
    [7, 33, 17],
    jnp.float32,
  )
  ppb = 2
  one = _check(family, args, PagedBlocks(ppb, 1))
  many = _check(family, args, PagedBlocks(ppb, 3))
  np.testing.assert_allclose(one, many, rtol=1e-5, atol=1e-6)
  _check(family, args)  # the heuristic's blocks


def test_lengths_past_the_page_table_attend_to_its_capacity_under_jit():
  """Concrete, such a length is an error (tested below); under jit (the rollout engine, whose finished
  slots step past their last page) it attends to the capacity, in both impls."""
  s = PAGED_SHAPES["tiny"]
  args = _draw(
    np.random.default_rng(3),
    s.batch,
    s.q_heads,
    s.kv_heads,
    s.head_dim,
    s.page_size,
    s.pages_per_seq,
    [s.ctx + 5, 3, 1000],
    jnp.float32,
  )
  cap = s.pages_per_seq * s.page_size
  clamped = (*args[:3], jnp.minimum(args[3], cap), args[4])
  expected = kernels.paged_attention_reference(*clamped)
  for call in IMPL_CALLS.values():
    out = jax.jit(lambda *a: kernels.paged_attention(*a, **call))(*args)  # noqa: B023
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


IMPL_CALLS = {
  "xla": dict(impl="xla"),
  **{f: dict(impl="pallas", platform=FAMILIES[f], interpret=True) for f in FAMILIES},
}


def _tiny_args(lengths, seed=5):
  s = PAGED_SHAPES["tiny"]
  return _draw(
    np.random.default_rng(seed),
    s.batch,
    s.q_heads,
    s.kv_heads,
    s.head_dim,
    s.page_size,
    s.pages_per_seq,
    lengths,
    jnp.float32,
  )


@pytest.mark.parametrize("impl", IMPL_CALLS)
def test_stale_nonfinite_kv_past_the_length_is_never_read(impl):
  """A recycled page keeps its old content: NaN / inf in K and V past a sequence's length (in its last,
  partial page and in the unreached pages of its row) leaves the output exactly as with clean pages."""
  lengths = [13, 37, 1]
  q, k, v, lens, pages = _tiny_args(lengths)
  ps = k.shape[2]
  k_bad, v_bad = np.array(k), np.array(v)
  for b, length in enumerate(lengths):
    row = np.asarray(pages[b])
    for t in range(length, row.size * ps):  # every slot past the length
      k_bad[:, row[t // ps], t % ps] = np.nan if t % 2 else np.inf
      v_bad[:, row[t // ps], t % ps] = np.inf if t % 2 else np.nan
  call = IMPL_CALLS[impl]
  clean = kernels.paged_attention(q, k, v, lens, pages, **call, blocks=None)
  dirty = kernels.paged_attention(q, jnp.asarray(k_bad), jnp.asarray(v_bad), lens, pages, **call)
  assert np.isfinite(np.asarray(dirty)).all()
  np.testing.assert_array_equal(dirty, clean)
  # with 2-page blocks the last block is partial: the mask must cover it too
  if impl != "xla":
    blocks = PagedBlocks(2, 2)
    clean = kernels.paged_attention(q, k, v, lens, pages, **call, blocks=blocks)
    dirty = kernels.paged_attention(
      q, jnp.asarray(k_bad), jnp.asarray(v_bad), lens, pages, **call, blocks=blocks
    )
    np.testing.assert_array_equal(dirty, clean)


def test_overflowing_scores_are_nan_in_every_impl():
  """q = 3e38 makes the scores overflow f32: every impl says NaN for that sequence (the kernels used
  to return silent zeros), and the other sequences are untouched."""
  q, k, v, lens, pages = _tiny_args([13, 37, 20])
  q = q.at[1].set(3e38)
  outs = {
    name: kernels.paged_attention(q, k, v, lens, pages, **c) for name, c in IMPL_CALLS.items()
  }
  for name, out in outs.items():
    out = np.asarray(out)
    assert np.isnan(out[1]).all(), name
    assert np.isfinite(out[[0, 2]]).all(), name
    assert_close(out[[0, 2]], np.asarray(outs["xla"])[[0, 2]], "attention", jnp.float32, 40, name)


@pytest.mark.parametrize("impl", IMPL_CALLS)
def test_unreached_page_ids_are_never_used(impl):
  """Ids past a sequence's length may be anything (-1, 99): the output equals that with filler 0."""
  q, k, v, lens, pages = _tiny_args([13, 1, 40])
  junk = pages.at[0, 2:].set(-1).at[1, 1:].set(99)
  call = IMPL_CALLS[impl]
  np.testing.assert_array_equal(
    kernels.paged_attention(q, k, v, lens, junk, **call),
    kernels.paged_attention(q, k, v, lens, pages, **call),
  )


@pytest.mark.parametrize("impl", IMPL_CALLS)
@pytest.mark.parametrize(
  "lengths,bad_page,match",
  [
    (
      [13, -1, 40],
      None,
      r"lengths must be in \[0, pages_per_seq \* page_size = 40\], got lengths\[1\] = -1",
    ),
    ([13, 41, 40], None, r"lengths\[1\] = 41"),
    ([13, 1, 40], (2, 4, 99), r"reached \(within lengths\) page_indices outside \[0, 18\)"),
    ([13, 1, 40], (0, 1, -1), r"page_indices outside \[0, 18\); first at \(0, 1\): -1"),
  ],
)
def test_bad_lengths_and_page_ids_raise(impl, lengths, bad_page, match):
  q, k, v, lens, pages = _tiny_args(lengths)
  if bad_page is not None:
    pages = pages.at[bad_page[:2]].set(bad_page[2])
  with pytest.raises(ValueError, match=match):
    kernels.paged_attention(q, k, v, lens, pages, **IMPL_CALLS[impl])


@pytest.mark.parametrize("impl", IMPL_CALLS)
def test_bad_lengths_and_page_ids_poison_their_sequence_under_jit(impl):
  """jit hides the values: a negative length or a reached page id outside [0, P) makes that sequence's
  output NaN (never a read of another page, never zeros); the other sequences are unchanged."""
  q, k, v, lens, pages = _tiny_args([13, 20, 40])
  call = IMPL_CALLS[impl]
  f = jax.jit(lambda ln, pg: kernels.paged_attention(q, k, v, ln, pg, **call))
  good = np.asarray(f(lens, pages))
  assert np.isfinite(good).all()
  for new_lens, new_pages, row in (
    (lens.at[0].set(-3), pages, 0),
    (lens, pages.at[1, 2].set(18), 1),  # P = 18: one past the pool
    (lens, pages.at[2, 0].set(-1), 2),
  ):
    out = np.asarray(f(new_lens, new_pages))
    assert np.isnan(out[row]).all(), row
    others = [i for i in range(3) if i != row]
    np.testing.assert_array_equal(out[others], good[others])


def test_bench_inputs_match_at_cpu_size():
  args = make_inputs(PAGED_SHAPES["cpu-small"], seed=0)
  _check("tiled", args, dtype=jnp.bfloat16, ctx=PAGED_SHAPES["cpu-small"].ctx)


def test_reference_agrees_withjax_shipped_paged_attention_gpu_op():
  """Cross-check against JAX's own GPU paged-attention op (run in the interpreter), through the
  bench's wrapper — which is also what the GPU bench rows time."""
  from bench.kernels.cases.paged_attention import jax_shipped_paged_attention

  args = _draw(np.random.default_rng(4), 2, 4, 2, 16, 16, 8, [37, 128], jnp.float32)
  assert_close(
    jax_shipped_paged_attention("gpu", *args, interpret=True),
    kernels.paged_attention_reference(*args),
    "attention",
    jnp.float32,
    128,
  )


def test_default_blocks():
  """GPU: 64-token tiles in a 4-stage pipeline; no split at decode-4k (B x Hkv = 128 programs already
  fill 97 % of the 132 SMs: splitting to 512 programs, as the old heuristic did, runs ~3.9 waves),
  the wave rule's 7 splits at decode-16k-b8, never more splits than blocks."""
  from kernels.backend import Target

  gpu = default_blocks(Target("gpu"), batch=64, num_kv_heads=2, pages_per_seq=256, page_size=16)
  assert gpu == PagedBlocks(4, 1, num_stages=4, num_warps=4)
  long = default_blocks(Target("gpu"), batch=8, num_kv_heads=2, pages_per_seq=1024, page_size=16)
  assert long.num_splits == 7 and long.pages_per_block == 4
  short = default_blocks(Target("gpu"), batch=1, num_kv_heads=1, pages_per_seq=8, page_size=16)
  assert short.num_splits * short.pages_per_block <= 8  # never more splits than blocks
  tpu = default_blocks(Target("tpu"), batch=64, num_kv_heads=2, pages_per_seq=256, page_size=16)
  assert tpu == PagedBlocks(64, 1)  # 1024-token blocks


@pytest.mark.parametrize("work,blocks_total", [(1, 1), (1, 300), (3, 40), (16, 256), (100, 64)])
def test_wave_splits_follows_the_flash_attention_rule(work, blocks_total):
  """FlashAttention-2's rule, checked by its definition: no split once work >= 0.8 x SMs; otherwise
  the chosen count is eligible (it changes ceil(blocks / splits)), within 85 % of the best wave
  efficiency, and no smaller eligible count is. Catches a heuristic that splits for occupancy
  alone (the old one: 2 programs per SM, whatever the waves)."""
  sms = plan.H100_SMS
  s = plan.wave_splits(work, blocks_total)
  assert 1 <= s <= max(blocks_total, 1)
  if work >= 0.8 * sms or blocks_total == 1:
    assert s == 1
    return
  ceil = lambda n: -(-blocks_total // n)
  eligible = [
    n for n in range(1, min(128, sms, blocks_total) + 1) if n == 1 or ceil(n) != ceil(n - 1)
  ]
  eff = {n: work * n / sms / -(-(work * n) // sms) for n in eligible}
  best = max(eff.values())
  assert s in eligible and eff[s] >= 0.85 * best
  assert all(eff[n] < 0.85 * best for n in eligible if n < s)
  assert plan.wave_splits(128, 256) == 1  # decode-4k: B 64 x 2 kv heads


@pytest.mark.parametrize("shape_name", PRODUCTION_PAGED_SHAPES)
def test_launch_plan_accounts_for_the_production_shapes(shape_name):
  """The byte account behind the kernels' docstrings: its ideal bytes are the bench's own count
  (PagedShape.kv_bytes), blocks only round up (moved >= ideal, by < one block per program), stages - 1
  blocks are in flight per CTA, and both kernels' defaults keep more than Little's law's bytes in
  flight per SM and a tail bound under the issue's 0.11 ms (decode-4k). And the docstrings quote
  these very figures: a heuristic change that alters them fails here until the text follows."""
  from kernels.paged_attention import mosaic_gpu, mosaic_gpu_blocks, pallas_triton
  from kernels.paged_attention.pallas_blocks import default_blocks as triton_blocks

  s = PAGED_SHAPES[shape_name]
  dims = dict(batch=s.batch, kv_heads=s.kv_heads, head_dim=s.head_dim, page_size=s.page_size)
  dims.update(pages_per_seq=s.pages_per_seq, lengths=s.lengths())
  tb = triton_blocks(Target("gpu"), s.batch, s.kv_heads, s.pages_per_seq, s.page_size)
  mb = mosaic_gpu_blocks.default_blocks(
    s.batch, s.kv_heads, s.pages_per_seq, s.page_size, s.head_dim, s.dtype
  )
  plans = {
    pallas_triton: tb.plan(**dims, q_heads=s.q_heads, itemsize=2),
    mosaic_gpu: mb.plan(**dims, dtype=s.dtype),
  }
  for module, p in plans.items():
    assert p.ideal_bytes == s.kv_bytes()
    block = p.block_bytes
    assert p.ideal_bytes <= p.moved_bytes < p.ideal_bytes + block * p.programs
    assert p.in_flight_per_cta == (p.stages - 1) * block and p.stages >= 3
    assert p.in_flight_per_sm >= max(p.little_bytes, 32 * 1024)
    assert p.smem_per_cta <= 227 * 1024 and p.programs <= p.sms  # one wave
    assert p.bound_us < (110 if shape_name == "decode-4k" else 69)  # 0.11 ms; 3x jax's 0.208 ms
    assert p.summary() in " ".join(module.__doc__.split()), module.__name__


def test_blocks_validation():
  for kw, match in (
    (dict(num_stages=0), "num_stages must be a positive int"),
    (dict(num_stages=9), r"num_stages must be in \[1, 8\]"),
    (dict(num_warps=3), "num_warps must be 1, 2, 4, 8 or 16"),
    (dict(num_warps=True), "num_warps must be a positive int"),
  ):
    with pytest.raises(ValueError, match=match):
      PagedBlocks(4, 1, **kw)


@pytest.mark.parametrize(
  "bad,match",
  [
    (dict(q=jnp.zeros((2, 4))), r"\[B, Hq, D\]"),
    (dict(v_pages=jnp.zeros((2, 5, 8, 16))), "k_pages and v_pages"),
    (dict(q=jnp.zeros((2, 3, 16))), "multiple of Hkv"),
    (dict(q=jnp.zeros((2, 4, 8))), "head_dim"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), "lengths"),
    (dict(lengths=jnp.zeros((2,), jnp.float32)), "lengths"),
    (dict(page_indices=jnp.zeros((2,), jnp.int32)), "page_indices"),
    (dict(page_indices=jnp.zeros((3, 3), jnp.int32)), "page_indices must have shape"),
    (dict(page_indices=jnp.zeros((2, 3), jnp.float32)), "page_indices must have a integer"),
    (dict(q=jnp.zeros((2, 4, 16), jnp.int32)), "q must have a floating dtype"),
    (dict(scale=0.0), r"scale must be finite and in \(0, inf\)"),
    (dict(scale=float("nan")), "scale must be finite"),
    (dict(impl="triton"), "impl"),
  ],
)
def test_bad_input_is_a_clear_error(bad, match):
  args = dict(
    q=jnp.zeros((2, 4, 16)),
    k_pages=jnp.zeros((2, 6, 8, 16)),
    v_pages=jnp.zeros((2, 6, 8, 16)),
    lengths=jnp.zeros((2,), jnp.int32),
    page_indices=jnp.zeros((2, 3), jnp.int32),
  )
  args.update(bad)
  impl = args.pop("impl", "xla")
  with pytest.raises(ValueError, match=match):
    kernels.paged_attention(**args, impl=impl)


def test_dtype_errors_are_type_errors():
  with pytest.raises(TypeError, match="lengths must have a integer dtype"):
    kernels.paged_attention(
      jnp.zeros((2, 4, 16)),
      jnp.zeros((2, 6, 8, 16)),
      jnp.zeros((2, 6, 8, 16)),
      jnp.zeros((2,), jnp.float32),
      jnp.zeros((2, 3), jnp.int32),
    )


def test_illegal_blocks_are_rejected():
  args = _draw(np.random.default_rng(0), 1, 2, 1, 16, 4, 2, [5], jnp.float32)
  with pytest.raises(ValueError, match="Triton"):
    kernels.paged_attention(
      *args, impl="pallas", platform="gpu", interpret=True, blocks=PagedBlocks(2, 1)
    )
  with pytest.raises(ValueError, match="power of two"):
    kernels.paged_attention(
      *args, impl="pallas", platform="gpu", interpret=True, blocks=PagedBlocks(3, 1)
    )
  with pytest.raises(ValueError, match="page_size"):  # TPU bf16 pages need 16-row pages
    jax.jit(
      lambda *a: kernels.paged_attention(*a, impl="pallas", platform="tpu", interpret=False)
    ).trace(
      *[
        jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype)
        for x in args
      ]
    )
  with pytest.raises(ValueError, match="positive"):
    PagedBlocks(0, 1)


@pytest.mark.parametrize("shape_name", PRODUCTION_PAGED_SHAPES)
def test_tuner_candidates_are_legal_and_cover_the_heuristic(shape_name):
  """bench.tune's GPU grid at the production shapes: every candidate passes its blocks' own check
  (the tuner would otherwise spend a compile on an error), stages / warps / splits all vary, the
  Mosaic GPU ring reaches >= 3 stages, both kernels' default blocks are among the candidates (the
  tuner can only improve on the heuristic), and the grid stays small enough to tune in minutes."""
  from bench import tune
  from bench.kernels.autotune_search import Problem
  from kernels.paged_attention import OP, mosaic_gpu_blocks

  s = PAGED_SHAPES[shape_name]
  shape = dict(dtype=s.dtype, batch=s.batch, q_heads=s.q_heads, kv_heads=s.kv_heads)
  shape.update(head_dim=s.head_dim, page_size=s.page_size, ctx=s.ctx)
  cands = tune.candidates(Problem(OP, shape, None, None, ()), "gpu")
  triton = [c.blocks for c in cands if c.impl == "pallas"]
  mosaic = [c.blocks for c in cands if c.impl == "mosaic_gpu"]
  for b in triton:
    b.check(Target("gpu"), s.page_size, s.head_dim, 2)
  for b in mosaic:
    b.check(s.page_size, s.head_dim, s.dtype, s.pages_per_seq)
  assert {b.num_stages for b in triton} >= {2, 3, 4} and {b.num_warps for b in triton} == {4, 8}
  assert len({b.num_splits for b in triton}) >= 2 and max(b.stages for b in mosaic) >= 3
  assert default_blocks(Target("gpu"), s.batch, s.kv_heads, s.pages_per_seq, s.page_size) in triton
  dims = (s.batch, s.kv_heads, s.pages_per_seq, s.page_size, s.head_dim, s.dtype)
  assert mosaic_gpu_blocks.default_blocks(*dims) in mosaic
  assert len(cands) <= 120
