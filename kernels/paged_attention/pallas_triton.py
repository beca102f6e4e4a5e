"""Pallas paged decode attention, rowloop family (GPU, lowered by Triton): one query token per
sequence, keys and values scattered over pages.

For one (sequence b, kv head h, split s), the online softmax (:mod:`.softmax`) of the G = Hq / Hkv
query heads that share kv head h over the split's pages, so every K/V page is read once per kv head;
each split writes its normalised output and its log-sum-exp (`reference.combine_splits` merges them).

Grid (B, Hkv, splits); each program walks its split with a `fori_loop` whose trip count comes from
the length (an `scf.for` in the Triton IR), gathering `pages_per_block` pages per step with one
vector load of their ids and one masked gather each of K and V, which feed the two dots directly:
Triton's software pipeliner (`num_stages` in the compiler params) issues them as asynchronous copies
into shared memory `num_stages - 1` blocks ahead. The G query heads of the kv head (padded to
Triton's 16-row dot minimum) form one [G, D] x [D, bk] tensor-core dot.

Launch account at the bench's production shapes with the default blocks (64-token
blocks, 4 stages, 4 warps; H100: 132 SMs, ~3.0 TB/s, ~1 us latency; :meth:`PagedBlocks.plan`,
re-derived by a test; shared memory is an estimate, Triton allocates it):

* decode-4k (B 64, 16 q / 2 kv heads, D 128, page 16, ctx 4096, 1 split):
  128 programs on 132 SMs (97% of a wave), block 32 KiB x 4 stages, in flight 96 KiB/SM (Little:
  22 KiB), smem 132 KiB/CTA, busiest program 2.00 MiB, ideal 238.1 MB = 79 us at 3.0 TB/s, tail
  bound 89 us
* decode-16k-b8 (B 8, ctx 16384, 7 splits by the wave rule):
  112 programs on 132 SMs (85% of a wave), block 32 KiB x 4 stages, in flight 96 KiB/SM (Little:
  22 KiB), smem 132 KiB/CTA, busiest program 1.16 MiB, ideal 133.1 MB = 44 us at 3.0 TB/s, tail
  bound 45 us

The case for the target is the Mosaic GPU kernel's (:mod:`.mosaic_gpu`): one wave at 97 %, 96 KiB in
flight per SM against the ~23 KiB Little's law asks, a tail bound of 89 us (decode-4k, <= 0.11 ms and
3.7x jax's 0.329 ms) and 45 us (decode-16k-b8, 4.6x jax's 0.208 ms). It holds only if Triton does
pipeline the gathers (its pipeliner handles indirect loads whose ids are loaded in the loop); the
previous defaults (128-token blocks, 2 stages, split-K to 512 programs) measured 0.312 / 0.174 ms.
Unmeasured here: no GPU was available.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend
from kernels.paged_attention.pallas_blocks import PagedConfig
from kernels.paged_attention.softmax import MASK, finish, online_update


def _rowloop_kernel(
  lengths_ref,
  pages_ref,
  q_ref,
  k_ref,
  v_ref,
  o_ref,
  lse_ref,
  *,
  ppb,
  page_size,
  blocks_per_split,
  scale,
):
  s = pl.program_id(2)
  bk = ppb * page_size
  length = lengths_ref[0]
  q = q_ref[...]  # [Gp, D]
  g, d = q.shape
  split_start = s * blocks_per_split * bk
  trips = jnp.clip(lax.div(jnp.maximum(length - split_start, 0) + bk - 1, bk), 0, blocks_per_split)

  def body(j, carry):
    m, l, acc = carry
    pages = pages_ref[pl.ds(j * ppb, ppb)]  # the block's page ids: one vector load, then one gather
    pos = split_start + j * bk + jnp.arange(bk)
    valid = pos < length
    # Masked gathers: slots past the length are neither read nor trusted (a recycled page's stale
    # NaN / inf becomes 0), and k / v feed the dots straight from the load, which Triton's software
    # pipeliner turns into asynchronous copies `num_stages - 1` blocks ahead.
    # Every axis indexed by an array (not page ids + slices): the interpreter's masked load takes
    # only that form, and Triton lowers both to the same pointer tensor.
    idx = (pages[:, None, None], jnp.arange(page_size)[None, :, None], jnp.arange(d)[None, None, :])
    live = jnp.broadcast_to(valid.reshape(ppb, page_size, 1), (ppb, page_size, d))
    k = backend.masked_load(k_ref.at[idx], mask=live, other=0).reshape(bk, d)
    v = backend.masked_load(v_ref.at[idx], mask=live, other=0).reshape(bk, d)
    return online_update(q, k, v, valid[None, :], None, m, l, acc, scale)

  init = (
    jnp.full((g, 1), MASK, jnp.float32),
    jnp.zeros((g, 1), jnp.float32),
    jnp.zeros((g, d), jnp.float32),
  )
  m, l, acc = lax.fori_loop(0, trips, body, init)
  out, lse = finish(m, l, acc)
  o_ref[...] = out
  lse_ref[...] = lse[:, 0]


def splits(cfg: PagedConfig, q, k_pages, v_pages, lengths, page_indices):
  b, hkv, g, d = q.shape
  _, num_pages, page_size, _ = k_pages.shape
  ppb, splits = cfg.blocks.pages_per_block, cfg.blocks.num_splits
  pages_per_split = page_indices.shape[1] // splits
  kernel = functools.partial(
    _rowloop_kernel,
    ppb=ppb,
    page_size=page_size,
    blocks_per_split=pages_per_split // ppb,
    scale=cfg.scale,
  )
  pages_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda bi, h, s: (h, 0, 0, 0))
  return pl.pallas_call(
    kernel,
    grid=(b, hkv, splits),
    in_specs=[
      pl.BlockSpec((None, 1), lambda bi, h, s: (bi, 0)),
      pl.BlockSpec((None, None, pages_per_split), lambda bi, h, s: (bi, s, 0)),
      pl.BlockSpec((None, None, g, d), lambda bi, h, s: (bi, h, 0, 0)),
      pages_spec,
      pages_spec,
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, g, d), lambda bi, h, s: (s, bi, h, 0, 0)),
      pl.BlockSpec((None, None, None, g), lambda bi, h, s: (s, bi, h, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((splits, b, hkv, g, d), jnp.float32),
      jax.ShapeDtypeStruct((splits, b, hkv, g), jnp.float32),
    ],
    compiler_params=backend.compiler_params(
      cfg.target, num_warps=cfg.blocks.num_warps, num_stages=cfg.blocks.num_stages
    ),
    interpret=cfg.target.interpret,
    name="paged_attention_rowloop",
  )(lengths[:, None], page_indices.reshape(b, splits, pages_per_split), q, k_pages, v_pages)
