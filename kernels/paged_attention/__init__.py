"""``paged_attention``: decode attention of one new token per sequence over a paged KV cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels import backend, checks
from kernels.paged_attention.impls import IMPLEMENTATIONS, OP, Call
from kernels.paged_attention.pallas_blocks import PagedBlocks, default_blocks
from kernels.paged_attention.reference import gather_pages, paged_attention_reference
from kernels.sharding import KernelSharding, local_batch

__all__ = [
  "IMPLEMENTATIONS",
  "IMPLS",
  "OP",
  "PagedBlocks",
  "default_blocks",
  "gather_pages",
  "paged_attention",
  "paged_attention_reference",
]

# ("auto", "pallas", "xla", "mosaic_gpu"): the table's, for callers that list them
IMPLS = OP.choices


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
  sharding: KernelSharding | None = None,  # sequences' and kv heads' mesh axes: runs shard-local
):  # -> [B, Hq, D] in q's dtype
  """Grouped-query softmax attention of each sequence's query over its first ``lengths[b]`` tokens.

  Token t of sequence b lives in page ``page_indices[b, t // page_size]`` at slot ``t % page_size``.
  Only the pages a sequence's length reaches are read; the ids of the rest of its row are never used
  (any value is fine). A length of 0 (an idle slot) gives zeros, never NaN. K / V slots past a
  sequence's length (a recycled page's stale content, NaN / inf included) never reach its result.
  Scores and softmax are f32, ``scale`` defaults to 1/sqrt(D). Scores that overflow f32 (q = 3e38)
  give NaN in every impl, never zeros.

  Bad input: a ValueError (an :class:`kernels.checks.ArgumentTypeError`, also a TypeError, for a
  wrong dtype) naming the argument, before anything compiles: shapes, dtypes, ``scale`` <= 0 or
  non-finite, and where the values are concrete: a negative length, a length above
  ``pages_per_seq * page_size``, a page id outside [0, P) among the pages a length reaches. Under
  ``jax.jit`` (the rollout engine): a length above the capacity attends to the capacity (the engine's
  finished slots rely on it), while a negative length or a reached page id outside [0, P) makes that
  sequence's output NaN (both impls), never a read of another page.

  Args:
    impl: ``"pallas"`` (TPU Mosaic, GPU Triton, or the CPU interpreter), ``"xla"`` (gather the pages
      into a dense context, then attention: the reference), ``"auto"``: xla on CPU, where the
      interpreter is only a correctness tool, else pallas.
    platform, interpret: the kernel target (see :func:`kernels.backend.resolve`).
    blocks: override the block heuristic (:func:`default_blocks`).
    sharding: inputs sharded over a mesh, e.g. ``KernelSharding(mesh, batch_axes=("dp",),
      head_axis="tp")``: the sequences (q, lengths, page_indices) split over ``batch_axes``, the kv
      heads (k_pages, v_pages; q's heads with their kv head) over ``head_axis``; the page pool is
      not split over the batch axes (any sequence may use any page). B and Hkv must divide evenly.
      The kernel runs shard-local in a ``shard_map`` (XLA cannot partition a Mosaic call) with
      blocks for the local B / Hkv; ``vocab_axis`` is unused here. The xla impl ignores it.
  """
  OP.check(impl)
  q, k_pages, v_pages = (checks.as_array(n, a) for n, a in zip(_KV_NAMES, (q, k_pages, v_pages)))
  lengths = checks.as_array("lengths", lengths)
  page_indices = checks.as_array("page_indices", page_indices)
  b, hq, d, hkv, page_size, pages_per_seq = _validate(q, k_pages, v_pages, lengths, page_indices)
  scale = checks.real("scale", d**-0.5 if scale is None else scale, lo=0.0, lo_open=True)
  lengths, page_indices, poisoned = _checked_table(
    lengths, page_indices, k_pages.shape[1], page_size
  )
  target = backend.resolve(platform, interpret)
  b, hq, hkv = _local_sizes(sharding, b, hq, hkv)  # what one shard's kernel sees
  shape = dict(dtype=jnp.dtype(k_pages.dtype).name, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=page_size, ctx=pages_per_seq * page_size)  # fmt: skip
  impl, blocks = OP.resolve(impl, blocks, target, shape)
  arrays = (q, k_pages, v_pages, lengths, page_indices)
  out = OP[impl].run(Call(arrays, scale, target, blocks, sharding, shape))
  return jnp.where(poisoned[:, None, None], jnp.nan, out).astype(out.dtype)


_KV_NAMES = ("q", "k_pages", "v_pages")


def _local_sizes(sharding: KernelSharding | None, b: int, hq: int, hkv: int):
  """(B, Hq, Hkv) of one shard; ValueError when the batch or kv-head axes do not divide them."""
  if sharding is None:
    return b, hq, hkv
  sharding.check_axis("head_axis", "Hkv", hkv)
  heads = sharding.axis_size(sharding.head_axis)
  return local_batch(sharding, "q", b), hq // heads, hkv // heads


def _checked_table(
  lengths,  # [B] int
  page_indices,  # [B, pages_per_seq] int
  num_pages: int,
  page_size: int,
):  # -> (lengths [B] int32 in [0, capacity], page ids [B, pages_per_seq] in [0, P), poisoned [B] bool)
  """Reject (concrete) or neutralise (traced) bad lengths and page ids, identically for every impl.

  Traced: lengths are clamped to [0, capacity]; the ids of pages no length reaches become 0; a
  sequence with a negative length or a reached id outside [0, P) is flagged for a NaN output, and
  its bad ids become 0 so that no impl ever reads outside the pool.
  """
  pages_per_seq = page_indices.shape[1]
  capacity = pages_per_seq * page_size
  if checks.is_concrete(lengths):
    arr = np.asarray(lengths)
    if (arr < 0).any() or (arr > capacity).any():
      first = int(np.argmax((arr < 0) | (arr > capacity)))
      raise ValueError(
        f"lengths must be in [0, pages_per_seq * page_size = {capacity}], got lengths[{first}] = "
        f"{int(arr[first])}"
      )
  reached = jnp.arange(pages_per_seq)[None, :] * page_size < lengths[:, None]  # [B, pages_per_seq]
  checks.index_range(
    "page_indices", page_indices, num_pages, where=reached, qualifier="reached (within lengths)"
  )
  out_of_pool = reached & ((page_indices < 0) | (page_indices >= num_pages))
  poisoned = (lengths < 0) | jnp.any(out_of_pool, axis=1)
  safe_pages = jnp.where(reached & ~out_of_pool, page_indices, 0).astype(jnp.int32)
  return jnp.clip(lengths, 0, capacity).astype(jnp.int32), safe_pages, poisoned


def _validate(q, k_pages, v_pages, lengths, page_indices):
  checks.ndim_array("q", q, 3, "[B, Hq, D]")
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise ValueError(
      f"k_pages and v_pages must both be [Hkv, P, page_size, D]; got {k_pages.shape} "
      f"and {v_pages.shape}"
    )
  for name, arr in zip(_KV_NAMES, (q, k_pages, v_pages)):
    checks.dtype_kind(name, arr, "floating")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
  b, hq, d = q.shape
  hkv, num_pages, page_size, dk = k_pages.shape
  if dk != d:
    raise ValueError(f"head_dim of q ({d}) and of the pages ({dk}) differ")
  if hq % hkv:
    raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
  if min(num_pages, page_size) < 1:
    raise ValueError(f"k_pages needs at least one page of at least one slot, got {k_pages.shape}")
  checks.shape("lengths", lengths, (b,), f" (one length per sequence of q {tuple(q.shape)})")
  checks.dtype_kind("lengths", lengths, "integer")
  checks.ndim_array("page_indices", page_indices, 2, f"[B={b}, pages_per_seq]")
  checks.shape("page_indices", page_indices, (b, page_indices.shape[1]), f" with B={b}")
  checks.dtype_kind("page_indices", page_indices, "integer")
  if page_indices.shape[1] == 0:
    raise ValueError("page_indices has no pages per sequence")
  return b, hq, d, hkv, page_size, page_indices.shape[1]
