"""paged_attention bench cases: our Pallas kernel and, where the backend ships one, JAX's own paged-
attention op, each against the gather + dense XLA reference. Decode is bandwidth-bound: the roofline
figure is the KV bytes read over the time."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from bench.kernels.cases import Case, Check
from bench.shapes import PAGED_SHAPES, PRODUCTION_PAGED_SHAPES, PagedShape

SHAPES_BY_SIZE = {"tiny": ("tiny",), "small": ("cpu-small",), "large": PRODUCTION_PAGED_SHAPES}


def make_inputs(shape: PagedShape, seed: int):
  """q and a shuffled page pool (every sequence's pages scattered, as after many allocations)."""
  k = jax.random.split(jax.random.key(seed), 4)
  b, hkv, d, ps, pps = (
    shape.batch,
    shape.kv_heads,
    shape.head_dim,
    shape.page_size,
    shape.pages_per_seq,
  )
  pool = b * pps
  q = jax.random.normal(k[0], (b, shape.q_heads, d), jnp.float32).astype(shape.dtype)
  k_pages = jax.random.normal(k[1], (hkv, pool, ps, d), jnp.float32).astype(shape.dtype)
  v_pages = jax.random.normal(k[2], (hkv, pool, ps, d), jnp.float32).astype(shape.dtype)
  page_indices = jax.random.permutation(k[3], pool).reshape(b, pps).astype(jnp.int32)
  lengths = jnp.asarray(shape.lengths(), jnp.int32)
  return q, k_pages, v_pages, lengths, page_indices


def _ours(impl, platform, q, k_pages, v_pages, lengths, page_indices):
  return kernels.paged_attention(
    q, k_pages, v_pages, lengths, page_indices, impl=impl, platform=platform
  )


def jax_shipped_paged_attention(
  platform, q, k_pages, v_pages, lengths, page_indices, interpret=False
):
  """JAX's own op for this backend (jax.experimental.pallas.ops.{gpu,tpu}.paged_attention). Neither
  scales the scores, so q arrives pre-scaled by 1/sqrt(D)."""
  q = (q * q.shape[-1] ** -0.5).astype(q.dtype)
  if platform == "gpu":
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_op

    splits = next(c for c in (16, 8, 4, 2, 1) if page_indices.shape[1] % c == 0)
    ppcb = next(c for c in (8, 4, 2, 1) if page_indices.shape[1] // splits % c == 0)
    return gpu_op.paged_attention(
      q,
      k_pages,
      v_pages,
      page_indices,
      lengths,
      k_splits=splits,
      pages_per_compute_block=ppcb,
      interpret=interpret,
    )
  from jax.experimental.pallas.ops.tpu import paged_attention as tpu_op

  ppcb = next(c for c in (8, 4, 2, 1) if page_indices.shape[1] % c == 0)
  return tpu_op.paged_attention(
    q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=ppcb
  )


def cases(size: str, platform: str) -> list[Case]:
  out = []
  for name in SHAPES_BY_SIZE[size]:
    s = PAGED_SHAPES[name]
    item = np.dtype(jnp.dtype(s.dtype)).itemsize
    io = s.kv_bytes() + 2 * s.batch * s.q_heads * s.head_dim * item  # + q in, out
    flops = 4 * sum(s.lengths()) * s.q_heads * s.head_dim  # QK^T and PV
    check = (Check(0, "attention", s.dtype, s.ctx, "out"),)
    params = dict(
      batch=s.batch,
      q_heads=s.q_heads,
      kv_heads=s.kv_heads,
      head_dim=s.head_dim,
      ctx=s.ctx,
      page_size=s.page_size,
      dtype=s.dtype,
    )
    inputs = functools.partial(make_inputs, s)
    reference = functools.partial(_ours, "xla", platform)
    out.append(
      Case(
        "paged_attention/pallas",
        name,
        "fwd",
        inputs,
        functools.partial(_ours, "pallas", platform),
        reference,
        io,
        flops,
        check,
        {**params, "impl": "pallas"},
      )
    )
    if platform in ("gpu", "tpu"):
      out.append(
        Case(
          "paged_attention/jax-shipped",
          name,
          "fwd",
          inputs,
          functools.partial(jax_shipped_paged_attention, platform),
          reference,
          io,
          flops,
          check,
          {**params, "impl": f"jax.experimental.pallas.ops.{platform}"},
        )
      )
  return out
