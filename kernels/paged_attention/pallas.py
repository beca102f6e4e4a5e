"""The ``pallas`` impl of paged attention: one entry over its two kernel families, chosen by the
target.

  tiled   (TPU, CPU interpreter): :mod:`kernels.paged_attention.pallas_tpu`
  rowloop (GPU / Triton):         :mod:`kernels.paged_attention.pallas_triton`

Both families compute, for one (sequence b, kv head h, split s), the online softmax of the G = Hq / Hkv
query heads that share kv head h over the split's pages, so every K/V page is read once per kv head.
Each split writes its normalised output and its log-sum-exp; `reference.combine_splits` merges them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.paged_attention import pallas_tpu, pallas_triton
from kernels.paged_attention.pallas_blocks import PagedConfig
from kernels.paged_attention.reference import combine_splits

GPU_MIN_GROUP = (
  16  # Triton's dot needs >= 16 rows: the GPU kernel pads the q heads of a kv head to this
)


def paged_attention_splits(
  cfg: PagedConfig,
  q,  # [B, Hkv, G, D] (G padded to >= 16 for the GPU family)
  k_pages,
  v_pages,  # [Hkv, P, page_size, D]
  lengths,  # [B] int32
  page_indices,  # [B, splits * k * pages_per_block] int32
):  # -> ([S, B, Hkv, G, D] f32, [S, B, Hkv, G] f32)
  family = pallas_triton if cfg.target.family == "rowloop" else pallas_tpu
  return family.splits(cfg, q, k_pages, v_pages, lengths, page_indices)


@functools.partial(jax.jit, static_argnums=0)
def paged_attention(cfg: PagedConfig, q, k_pages, v_pages, lengths, page_indices):
  """[B, Hq, D] in q's dtype: the GQA groups padded for the family, the page table to whole blocks."""
  b, hq, d = q.shape
  hkv = k_pages.shape[0]
  g = hq // hkv
  qg = q.reshape(b, hkv, g, d).astype(
    k_pages.dtype
  )  # the MXU / tensor cores take both operands alike
  gp = g
  if cfg.target.family == "rowloop":
    gp = max(GPU_MIN_GROUP, 1 << (g - 1).bit_length())
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  per_step = cfg.blocks.pages_per_block * cfg.blocks.num_splits
  pad = -page_indices.shape[1] % per_step
  page_indices = jnp.pad(page_indices, ((0, 0), (0, pad)))  # filler page 0: beyond every length
  o, lse = paged_attention_splits(cfg, qg, k_pages, v_pages, lengths, page_indices)
  out = o[0] if cfg.blocks.num_splits == 1 else combine_splits(o, lse)
  return out[:, :, :g].reshape(b, hq, d).astype(q.dtype)
