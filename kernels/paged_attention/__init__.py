"""``paged_attention``: decode attention of one new token per sequence over a paged KV cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import autotune, backend
from kernels.paged_attention import mosaic_gpu as _mosaic_gpu
from kernels.paged_attention.blocks import PagedBlocks, default_blocks
from kernels.paged_attention.pallas import PagedConfig, paged_attention_splits
from kernels.paged_attention.reference import (
  combine_splits,
  gather_pages,
  paged_attention_reference,
)

__all__ = [
  "IMPLS",
  "PagedBlocks",
  "default_blocks",
  "gather_pages",
  "paged_attention",
  "paged_attention_reference",
]

IMPLS = ("auto", "pallas", "xla", "mosaic_gpu")
GPU_MIN_GROUP = (
  16  # Triton's dot needs >= 16 rows: the GPU kernel pads the q heads of a kv head to this
)


def paged_attention(
  q,  # [B, Hq, D] one new token per sequence
  k_pages,  # [Hkv, P, page_size, D]
  v_pages,  # [Hkv, P, page_size, D]
  lengths,  # [B] int32 tokens in each sequence's cache, the new one included
  page_indices,  # [B, pages_per_seq] int32 page ids into P
  *,
  scale: float | None = None,
  impl: str = "auto",
  platform: backend.Platform | None = None,
  interpret: bool | None = None,
  blocks: PagedBlocks | None = None,
):  # -> [B, Hq, D] in q's dtype
  """Grouped-query softmax attention of each sequence's query over its first ``lengths[b]`` tokens.

  Token t of sequence b lives in page ``page_indices[b, t // page_size]`` at slot ``t % page_size``.
  Every page id must be in [0, P), including the unused tail of a row (0 is a fine filler: it is never
  read into the result). Lengths above ``pages_per_seq * page_size`` attend to that many tokens; a
  length of 0 (an idle slot) gives zeros, never NaN. Scores and softmax are f32, ``scale`` defaults to
  1/sqrt(D).

  Args:
    impl: ``"pallas"`` (TPU Mosaic, GPU Triton, or the CPU interpreter), ``"xla"`` (gather the pages
      into a dense context, then attention: the reference), ``"auto"``: xla on CPU, where the
      interpreter is only a correctness tool, else pallas.
    platform, interpret: the kernel target (see :func:`kernels.backend.resolve`).
    blocks: override the block heuristic (:func:`default_blocks`).
  """
  b, _hq, d, hkv, page_size, pages_per_seq = _validate(q, k_pages, v_pages, lengths, page_indices)
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  scale = float(d**-0.5 if scale is None else scale)
  target = backend.resolve(platform, interpret)
  impl, blocks = autotune.resolve("paged_attention", impl, blocks, target, dict(dtype=jnp.dtype(k_pages.dtype).name, batch=b, q_heads=_hq, kv_heads=hkv, head_dim=d, page_size=page_size, ctx=pages_per_seq * page_size))  # fmt: skip
  if impl == "auto":
    impl = "xla" if target.platform == "cpu" else "pallas"
  lengths = jnp.minimum(lengths, pages_per_seq * page_size)
  if impl == "xla":
    return paged_attention_reference(q, k_pages, v_pages, lengths, page_indices, scale=scale)
  if impl == "mosaic_gpu":  # the Mosaic GPU kernel (Hopper); impl="pallas" is Triton on GPU
    return _mosaic_gpu.paged_attention(q, k_pages, v_pages, lengths, page_indices, scale=scale, target=target, blocks=blocks)  # fmt: skip
  blocks = blocks or default_blocks(target, b, hkv, pages_per_seq, page_size)
  blocks.check(target, page_size, d, jnp.dtype(k_pages.dtype).itemsize)
  if target.platform == "gpu" and d & (d - 1):
    raise ValueError(f"the GPU kernel needs a power-of-two head_dim, got {d}")
  return _pallas(PagedConfig(target, blocks, scale), q, k_pages, v_pages, lengths, page_indices)


@functools.partial(jax.jit, static_argnums=0)
def _pallas(cfg: PagedConfig, q, k_pages, v_pages, lengths, page_indices):
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


def _validate(q, k_pages, v_pages, lengths, page_indices):
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise ValueError(
      f"k_pages and v_pages must both be [Hkv, P, page_size, D]; got {k_pages.shape} "
      f"and {v_pages.shape}"
    )
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
  b, hq, d = q.shape
  hkv, _, page_size, dk = k_pages.shape
  if dk != d:
    raise ValueError(f"head_dim of q ({d}) and of the pages ({dk}) differ")
  if hq % hkv:
    raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(
      f"lengths must be an integer [B={b}] array, got {lengths.dtype}{list(lengths.shape)}"
    )
  if (
    page_indices.ndim != 2
    or page_indices.shape[0] != b
    or not jnp.issubdtype(page_indices.dtype, jnp.integer)
  ):
    raise ValueError(
      f"page_indices must be an integer [B={b}, pages_per_seq] array, got "
      f"{page_indices.dtype}{list(page_indices.shape)}"
    )
  if page_indices.shape[1] == 0:
    raise ValueError("page_indices has no pages per sequence")
  return b, hq, d, hkv, page_size, page_indices.shape[1]
