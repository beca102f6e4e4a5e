"""One Pallas pass for an element-wise optimizer update: read param, grad and state once, write once.

Two families (see kernels.backend):
  tiled   (TPU, CPU interpreter): each array viewed as 2-D (free reshape) and tiled (bm, bc); partial
          edge tiles are handled by Pallas (out-of-range writes dropped).
  rowloop (GPU / Triton): each array flat, one program per ``block`` elements with masked loads and
          stores (Triton does not bounds-check block edges).
Scalars (learning rate, bias corrections) travel in SMEM on TPU and as a tiny array on GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend
from kernels.backend import Target


@dataclasses.dataclass(frozen=True)
class ElementwiseBlocks:
  """tiled: (block_rows, block_cols) over the 2-D view; rowloop: block_cols elements per program."""

  block_rows: int
  block_cols: int
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block_rows", "block_cols", "num_warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ElementwiseBlocks.{name} must be a positive int, got {value!r}")


def view_2d(shape) -> tuple[int, int]:
  """A lane-dense 2-D view of an array of ``shape`` that costs no copy (a reshape)."""
  n = math.prod(shape)
  for cols in (2048, 1024, 512, 256, 128):
    if n % cols == 0:
      return n // cols, cols
  if len(shape) >= 2:
    return n // shape[-1], shape[-1]
  return 1, max(n, 1)


def default_blocks(target: Target, rows: int, cols: int, n_arrays: int) -> ElementwiseBlocks:
  """TPU: ~256 KiB f32 tiles, so n_arrays double-buffered tiles stay far inside scoped VMEM.
  GPU: 2048 elements per program, 4 warps (16 per thread): a plain streaming kernel.
  CPU interpreter: as large as possible (grid steps cost interpreter time)."""
  if target.family == "rowloop":
    return ElementwiseBlocks(1, 2048, 4)
  if target.platform == "tpu" and not target.interpret:
    bc = cols if cols <= 2048 else 2048
    bm = max(8, (65536 // bc) // 8 * 8)
    return ElementwiseBlocks(rows if rows <= bm else bm, bc)
  return ElementwiseBlocks(min(rows, 1024), min(cols, 8192))


def _check(blocks: ElementwiseBlocks, target: Target, rows: int, cols: int):
  if target.family == "rowloop":
    if blocks.block_cols & (blocks.block_cols - 1):
      raise ValueError(f"Triton tiles must be powers of two: block_cols={blocks.block_cols}")
  elif target.platform == "tpu" and not target.interpret:
    if blocks.block_rows % 8 and blocks.block_rows != rows:
      raise ValueError(f"TPU block_rows must be a multiple of 8 or equal {rows}")
    if blocks.block_cols % 128 and blocks.block_cols != cols:
      raise ValueError(f"TPU block_cols must be a multiple of 128 or equal {cols}")


def elementwise_call(
  body: Callable,
  inputs: dict[str, jax.Array],
  outputs: dict[str, jnp.dtype],
  scalars,
  *,
  target: Target,
  blocks: ElementwiseBlocks | None = None,
  in_place: bool = False,
  name: str = "elementwise",
):
  """Apply ``body(scalars, *f32 tiles of inputs) -> f32 tiles of outputs`` in one pass.

  inputs: name -> array, all of one shape; outputs: name -> dtype, in the order ``body`` returns them;
  scalars: f32 [k]. ``in_place``: each output named like an input of its dtype reuses that input's
  buffer (XLA copies it unless the caller donated it). Returns the outputs, named.
  """
  arrays = list(inputs.values())
  shape = arrays[0].shape
  n_in, n_out = len(arrays), len(outputs)
  out_dtypes = list(outputs.values())
  aliases = {}
  if in_place:
    in_index = {k: i for i, k in enumerate(inputs)}
    for o, (k, dtype) in enumerate(outputs.items()):
      if k in in_index and inputs[k].dtype == dtype:
        aliases[1 + in_index[k]] = o  # scalars are input 0
  body_fn = functools.partial(_tiled_body if target.family == "tiled" else _flat_body, body, n_in)
  if target.family == "tiled":
    rows, cols = view_2d(shape)
    blocks = blocks or default_blocks(target, rows, cols, n_in + n_out)
    _check(blocks, target, rows, cols)
    bm, bc = blocks.block_rows, blocks.block_cols
    spec = pl.BlockSpec((bm, bc), lambda i, j: (i, j))
    scalar_spec = (
      pl.BlockSpec(memory_space=backend.tpu_smem())
      if target.platform == "tpu" and not target.interpret
      else pl.BlockSpec(scalars.shape, lambda i, j: (0,))
    )
    outs = pl.pallas_call(
      body_fn,
      grid=(pl.cdiv(rows, bm), pl.cdiv(cols, bc)),
      in_specs=[scalar_spec] + [spec] * n_in,
      out_specs=[spec] * n_out,
      out_shape=[jax.ShapeDtypeStruct((rows, cols), d) for d in out_dtypes],
      input_output_aliases=aliases,
      compiler_params=backend.compiler_params(target, dimension_semantics=("parallel", "parallel")),
      interpret=target.interpret,
      name=name,
    )(scalars, *(a.reshape(rows, cols) for a in arrays))
  else:
    n = math.prod(shape)
    blocks = blocks or default_blocks(target, 1, n, n_in + n_out)
    _check(blocks, target, 1, n)
    whole = pl.BlockSpec((n,), lambda i: (0,))
    outs = pl.pallas_call(
      functools.partial(body_fn, n=n, block=blocks.block_cols),
      grid=(pl.cdiv(n, blocks.block_cols),),
      in_specs=[pl.BlockSpec(scalars.shape, lambda i: (0,))] + [whole] * n_in,
      out_specs=[whole] * n_out,
      out_shape=[jax.ShapeDtypeStruct((n,), d) for d in out_dtypes],
      input_output_aliases=aliases,
      compiler_params=backend.compiler_params(target, num_warps=blocks.num_warps, num_stages=1),
      interpret=target.interpret,
      name=name,
    )(scalars, *(a.reshape(n) for a in arrays))
  return {k: o.reshape(shape) for k, o in zip(outputs, outs)}


def _tiled_body(body, n_in, s_ref, *refs):
  ins, outs = refs[:n_in], refs[n_in:]
  scalars = tuple(s_ref[i] for i in range(s_ref.shape[0]))
  results = body(scalars, *(r[...].astype(jnp.float32) for r in ins))
  for ref, val in zip(outs, results):
    ref[...] = val.astype(ref.dtype)


def _flat_body(body, n_in, s_ref, *refs, n, block):
  ins, outs = refs[:n_in], refs[n_in:]
  start = pl.program_id(0) * block
  idx = start + jnp.arange(block, dtype=jnp.int32)
  valid = idx < n
  scalars = tuple(s_ref[i] for i in range(s_ref.shape[0]))
  vals = [
    backend.masked_load(r.at[pl.ds(start, block)], mask=valid, other=0.0).astype(jnp.float32)
    for r in ins
  ]
  for ref, val in zip(outs, body(scalars, *vals)):
    backend.masked_store(ref.at[pl.ds(start, block)], val.astype(ref.dtype), mask=valid)
