"""Parity of the Mosaic GPU paged decode attention (impl="mosaic_gpu") against the reference, run on CPU
through the Mosaic GPU interpreter (TMA page gathers, per-page barriers, the K/V ring, wgmma), and on a
GPU when there is one.

Untested by the interpreter, so covered by the AOT lowering (tests/kernels/test_lowering.py) and the
`gpu`-marked tests below: register layouts (``layout_cast`` is the identity there: the WGMMA layout of
the scores mask and of the last block's stale-V zeroing), the swizzled TMA tiles, the bulk copy of the
staged page ids, and, under jax 0.10 only, the scores wgmma with its transposed K operand (the 0.10
interpreter cannot read a transposed operand, so the kernel takes a plain dot there; jax 0.11 runs
the wgmma). Every other primitive of the kernel runs in both interpreters.
"""

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import kernels
from bench.shapes import PAGED_SHAPES
from bench.tolerances import assert_close
from kernels import backend
from kernels.paged_attention.mosaic_gpu_blocks import MosaicPagedBlocks, default_blocks
from tests.kernels.paged_attention.test_paged_attention import _draw
from tests.problems import SHAPE_SEARCH_ON_GPU_JAX


def _check(args, blocks=None, dtype=jnp.bfloat16, platform="cpu", interpret=True):
  ref = kernels.paged_attention(*args, impl="xla")
  out = kernels.paged_attention(
    *args, impl="mosaic_gpu", platform=platform, interpret=interpret, blocks=blocks
  )
  assert out.shape == ref.shape and out.dtype == ref.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert_close(out, ref, "attention", dtype, args[4].shape[1] * args[1].shape[2], f"{blocks}")
  return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_parity_idle_single_and_full_slots(dtype):
  """Hq = 16 over Hkv = 2 (G = 8 of the 64 wgmma rows), lengths 0 / 1 / full, 2 splits x 2 blocks."""
  rng = np.random.default_rng(1)
  args = _draw(rng, 3, 16, 2, 64, 16, 8, [0, 1, 128], dtype)
  out = _check(args, MosaicPagedBlocks(4, 2, 2), dtype)
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0 -> zeros


@SHAPE_SEARCH_ON_GPU_JAX
@given(
  data=st.data(),
  b=st.integers(1, 3),
  hkv=st.sampled_from([1, 2]),
  group=st.sampled_from([1, 3, 8]),
  d=st.sampled_from([64, 128]),
  page_size=st.sampled_from([8, 16, 32, 64]),
  tile=st.sampled_from([64, 128]),
  pps=st.integers(1, 9),
  splits=st.integers(1, 3),
  stages=st.integers(1, 3),
  dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
  seed=st.integers(0, 2**31 - 1),
)
def test_parity_hypothesis(
  data, b, hkv, group, d, page_size, tile, pps, splits, stages, dtype, seed
):
  """Ragged lengths (0 to capacity), page tables not a multiple of the block (padded with page 0),
  more stages than blocks, splits that see no token."""
  cap = pps * page_size
  lengths = data.draw(st.lists(st.integers(0, cap), min_size=b, max_size=b), label="lengths")
  args = _draw(np.random.default_rng(seed), b, group * hkv, hkv, d, page_size, pps, lengths, dtype)
  blocks = MosaicPagedBlocks(max(tile // page_size, 1), splits, stages)
  while blocks.stages > 1 and not _fits(blocks, page_size, d, dtype, pps):  # the smem budget
    blocks = MosaicPagedBlocks(blocks.pages_per_block, splits, blocks.stages - 1)
  _check(args, blocks, dtype)


def _fits(blocks, page_size, d, dtype, pages_per_seq) -> bool:
  try:
    blocks.check(page_size, d, dtype, pages_per_seq)
  except ValueError:
    return False
  return True


def test_default_blocks_at_tiny_and_production_shapes():
  """The heuristic's blocks run at the tiny shape; at the production shapes they are a >= 3-stage ring
  of 64-token tiles within the shared-memory budget, split by wave efficiency: none at decode-4k (128
  programs already fill 97 % of the 132 SMs; the old heuristic split to 512 programs, ~3.9 waves), and
  enough at decode-16k-b8 (16 programs alone would leave 88 % of the SMs idle)."""
  s = PAGED_SHAPES["tiny"]
  args = _draw(
    np.random.default_rng(2),
    s.batch,
    s.q_heads,
    s.kv_heads,
    64,
    16,
    s.pages_per_seq,
    [7, 33, 17],
    jnp.bfloat16,
  )
  _check(args)
  for name, splits in (("decode-4k", 1), ("decode-16k-b8", 7)):
    prod = PAGED_SHAPES[name]
    dims = (prod.batch, prod.kv_heads, prod.pages_per_seq, prod.page_size, prod.head_dim)
    blocks = default_blocks(*dims, jnp.bfloat16)
    blocks.check(prod.page_size, prod.head_dim, jnp.bfloat16, prod.pages_per_seq)
    assert blocks.pages_per_block * prod.page_size == 64 and blocks.stages >= 3, name
    assert blocks.num_splits == splits, name


# NaN keys reach the simulated q·kᵀ by design (masked after it, as on hardware): numpy warns there.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_stale_nonfinite_kv_past_the_length_is_never_read():
  """A recycled page keeps its old content: NaN / inf in K and V past each length (the rest of the
  last page, the unreached pages of the last block, the filler page 0 that pads the table) leaves the
  output exactly as with clean pages. The kernel used to feed those V rows to p·v with p = 0, and
  0 * NaN = NaN reached the output."""
  lengths = [13, 70, 0]
  q, k, v, lens, pages = _draw(np.random.default_rng(7), 3, 4, 1, 64, 8, 12, lengths, jnp.bfloat16)
  k_bad, v_bad = np.array(k, np.float32), np.array(v, np.float32)
  live = {(int(pages[b, t // 8]), t % 8) for b, n in enumerate(lengths) for t in range(n)}
  for page in range(k.shape[1]):
    for slot in range(8):
      if (page, slot) not in live:
        k_bad[:, page, slot] = np.nan if slot % 2 else np.inf
        v_bad[:, page, slot] = np.inf if slot % 2 else np.nan
  bad = (q, jnp.asarray(k_bad, k.dtype), jnp.asarray(v_bad, v.dtype), lens, pages)
  for blocks in (MosaicPagedBlocks(8, 1, 3), MosaicPagedBlocks(16, 2, 2)):
    kw = dict(impl="mosaic_gpu", platform="cpu", interpret=True, blocks=blocks)
    clean = kernels.paged_attention(q, k, v, lens, pages, **kw)
    dirty = kernels.paged_attention(*bad, **kw)
    assert np.isfinite(np.asarray(dirty, np.float32)).all(), blocks
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_page_ids_staged_over_several_rows():
  """A split of more than 128 pages stages its ids as several [<= 128] rows of shared memory (136
  pages of 8 here: 2 rows of 96): a wrong row / column for page k would read another page of the
  permuted table, and the output would differ from the reference."""
  rng = np.random.default_rng(9)
  args = _draw(rng, 1, 2, 1, 64, 8, 136, [1037], jnp.bfloat16, spare_pages=0)
  _check(args, MosaicPagedBlocks(16, 1, 3))


def test_recycled_pages_with_huge_stale_values_never_leak():
  """Tokens past a sequence's length may hold anything a recycled page left there; huge stale keys
  (scores ~1e6) must be masked before the running max, or they would swamp the softmax of the real
  tokens (and overflow exp)."""
  rng = np.random.default_rng(5)
  q, k, v, lengths, pages = _draw(rng, 2, 4, 1, 64, 16, 8, [20, 64], jnp.bfloat16)
  table = np.asarray(pages).copy()
  stale = table[0, 1]  # seq 0 reads tokens 0-19: page 1 holds 4 real tokens, then stale ones
  k = k.at[:, stale, 4:].set(1000.0)
  v = v.at[:, stale, 4:].set(1000.0)
  table[0, 2:] = table[1, 4:] = stale  # every page past the lengths is the stale one
  args = (q, k, v, lengths, jnp.asarray(table))
  out = _check(args, MosaicPagedBlocks(4, 2, 2))
  assert np.abs(np.asarray(out, np.float32)).max() < 10.0  # |v| of the real tokens is O(1)


@pytest.mark.parametrize(
  "kw,error,match",
  [
    (dict(blocks=MosaicPagedBlocks(2, 1)), ValueError, "multiple of 64"),
    (dict(blocks=MosaicPagedBlocks(32, 1)), ValueError, "<= 256"),
    (dict(blocks=MosaicPagedBlocks(4, 1, 16)), ValueError, "shared memory"),
    (dict(blocks=kernels.PagedBlocks(4, 1)), TypeError, "MosaicPagedBlocks"),
    (dict(platform="tpu", interpret=False), ValueError, "GPU kernel"),
  ],
)
def test_bad_settings_raise_before_lowering(kw, error, match):
  args = _draw(np.random.default_rng(0), 1, 2, 1, 64, 16, 4, [9], jnp.bfloat16)
  with pytest.raises(error, match=match):
    kernels.paged_attention(*args, impl="mosaic_gpu", **dict(dict(platform="cpu"), **kw))


@pytest.mark.parametrize(
  "dtype,d,page_size,match",
  [
    (jnp.float32, 64, 16, "tf32"),
    (jnp.bfloat16, 32, 16, "head_dim"),
    (jnp.bfloat16, 64, 4, "page_size"),
  ],
)
def test_unsupported_problems_raise(dtype, d, page_size, match):
  args = _draw(np.random.default_rng(0), 1, 2, 1, d, page_size, 16, [9], dtype)
  with pytest.raises(ValueError, match=match):
    kernels.paged_attention(*args, impl="mosaic_gpu", platform="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(backend.host_platform() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("shape_name", ["decode-4k", "decode-16k-b8"])
def test_parity_on_gpu_production_shape(shape_name):
  """On hardware: the scores wgmma with a transposed K tile, register layouts, swizzled TMA gathers."""
  from bench.kernels.cases.paged_attention import make_inputs

  s = PAGED_SHAPES[shape_name]
  args = make_inputs(s, seed=0)
  _check(args, dtype=jnp.dtype(s.dtype), platform="gpu", interpret=False)


@pytest.mark.gpu
@pytest.mark.skipif(backend.host_platform() != "gpu", reason="needs an NVIDIA GPU")
def test_stale_pages_never_leak_on_gpu_production_shape():
  """On hardware, at decode-4k: NaN in every K / V slot past each length (the zeroing of the last
  block's V rows in the WGMMA register layout, which the interpreter cannot check) leaves the
  output identical to that with clean pages."""
  from bench.kernels.cases.paged_attention import make_inputs

  q, k, v, lengths, pages = make_inputs(PAGED_SHAPES["decode-4k"], seed=0)
  ps = k.shape[2]
  pos = np.arange(pages.shape[1] * ps).reshape(pages.shape[1], ps)
  stale = np.zeros(k.shape[1:3], bool)
  table, lens = np.asarray(pages), np.asarray(lengths)
  stale[table.reshape(-1)] = True  # every page of a table, then clear the live slots
  for b in range(table.shape[0]):
    rows, slots = np.nonzero(pos < lens[b])
    stale[table[b, rows], slots] = False
  mask = jnp.asarray(stale)[None, :, :, None]
  bad_k, bad_v = jnp.where(mask, jnp.nan, k), jnp.where(mask, jnp.nan, v)
  kw = dict(impl="mosaic_gpu", platform="gpu", interpret=False)
  clean = np.asarray(kernels.paged_attention(q, k, v, lengths, pages, **kw))
  dirty = np.asarray(kernels.paged_attention(q, bad_k, bad_v, lengths, pages, **kw))
  assert np.isfinite(dirty.astype(np.float32)).all()
  np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize(
  "ring,pages_per_seq", [((4, 1, 4), 256), ((8, 7, 2), 1024), ((1, 3, 3), 5)]
)
def test_smem_account_is_the_kernels_allocation(ring, pages_per_seq):
  """MosaicPagedBlocks.smem_bytes (the budget check, the plan's smem figure) against the scratch the
  kernel really allocates, at D = 128 bf16, page 16 / 64: a buffer added to the kernel but not to the
  account would let the budget pass blocks that fail to launch (or misstate the docstrings)."""
  from kernels.paged_attention import mosaic_gpu, mosaic_gpu_blocks

  blocks = MosaicPagedBlocks(*ring)
  page_size = 64 // ring[0] if ring[0] > 1 else 64
  cfg = mosaic_gpu_blocks.MosaicPagedConfig(
    backend.make_target("gpu", interpret=False), blocks, 1.0
  )
  pps = mosaic_gpu_blocks.pages_per_split(pages_per_seq, blocks)
  bk = blocks.pages_per_block * page_size
  scratch = mosaic_gpu._scratch(cfg, bk, 128, jnp.bfloat16, mosaic_gpu_blocks.id_shape(pps))
  allocated = sum(
    int(np.prod(r.shape)) * jnp.dtype(r.dtype).itemsize for r in scratch if hasattr(r, "dtype")
  )
  assert blocks.smem_bytes(page_size, 128, jnp.bfloat16, pages_per_seq) == allocated
