"""The definition: gather each sequence's pages into a dense context, then grouped-query attention."""

from __future__ import annotations

import jax.numpy as jnp


def gather_pages(
  pages,  # [Hkv, P, page_size, D]
  page_indices,  # [B, pages_per_seq] int32
):  # -> [B, Hkv, pages_per_seq * page_size, D]
  """Each sequence's pages, in page-table order, as one dense context per kv head."""
  hkv, _, page_size, d = pages.shape
  b, n = page_indices.shape
  dense = pages[:, page_indices]  # [Hkv, B, n, page_size, D]
  return dense.transpose(1, 0, 2, 3, 4).reshape(b, hkv, n * page_size, d)


def paged_attention_reference(
  q,  # [B, Hq, D]
  k_pages,  # [Hkv, P, page_size, D]
  v_pages,  # [Hkv, P, page_size, D]
  lengths,  # [B] int32
  page_indices,  # [B, pages_per_seq] int32
  *,
  scale: float | None = None,
):  # -> [B, Hq, D] in q's dtype
  """Softmax attention of each sequence's one query per head over its first `lengths[b]` cached tokens.

  Scores and the softmax are f32; a sequence with length 0 gets zeros (not NaN); K / V past a
  sequence's length never reach its result, even when NaN / inf. Page ids and lengths are assumed
  valid (:func:`kernels.paged_attention` checks them).
  """
  b, hq, d = q.shape
  hkv = k_pages.shape[0]
  scale = d**-0.5 if scale is None else scale
  k = gather_pages(k_pages, page_indices)  # [B, Hkv, S, D]
  v = gather_pages(v_pages, page_indices)
  qg = q.reshape(b, hkv, hq // hkv, d)
  s = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
  visible = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [B, S]
  s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
  # Slots past the length may hold a recycled page's stale NaN / inf: p = 0 there, but 0 * NaN = NaN.
  v = jnp.where(visible[:, None, :, None], v, jnp.zeros((), v.dtype))
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bkgs,bksd->bkgd", p, v.astype(jnp.float32))
  return out.reshape(b, hq, d).astype(q.dtype)


def combine_splits(
  o,  # [S, B, Hkv, G, D] f32, each split normalised over its own tokens
  lse,  # [S, B, Hkv, G] f32, -inf for a split that saw no token
):  # -> [B, Hkv, G, D] f32
  """Merge split-K partial results exactly: weight each split by its share of the softmax mass."""
  m = jnp.max(lse, axis=0)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse - m[None])  # 0 for empty splits
  total = jnp.sum(w, axis=0)
  out = jnp.sum(w[..., None] * o, axis=0)
  return out / jnp.where(total > 0, total, 1.0)[..., None]


__all__ = ["combine_splits", "gather_pages", "paged_attention_reference"]
