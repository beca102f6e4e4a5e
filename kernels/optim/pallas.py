"""One Pallas pass per array for an element-wise optimizer update, the tiled family (TPU, and the CPU
interpreter of it): read param, grad and state once, write once. Each array is viewed as 2-D (a free
reshape) and tiled (bm, bc); partial edge tiles are handled by Pallas (out-of-range writes dropped).
Scalars (learning rate, bias corrections) travel in SMEM on TPU. The GPU (Triton) family updates a
whole tree in one launch instead: :mod:`kernels.optim.multi`.
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
  """(block_rows, block_cols) tiles over the 2-D view; num_warps is unused (kept for old callers)."""

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
  CPU interpreter: as large as possible (grid steps cost interpreter time)."""
  if target.platform == "tpu" and not target.interpret:
    bc = cols if cols <= 2048 else 2048
    bm = max(8, (65536 // bc) // 8 * 8)
    return ElementwiseBlocks(rows if rows <= bm else bm, bc)
  return ElementwiseBlocks(min(rows, 1024), min(cols, 8192))


def _check(blocks: ElementwiseBlocks, target: Target, rows: int, cols: int):
  if target.platform == "tpu" and not target.interpret:
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
  if target.family != "tiled":
    raise ValueError(f"elementwise_call is the tiled family's kernel, got {target}")
  body_fn = functools.partial(_tiled_body, body, n_in)
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
  return {k: o.reshape(shape) for k, o in zip(outputs, outs)}


def _tiled_body(body, n_in, s_ref, *refs):
  ins, outs = refs[:n_in], refs[n_in:]
  scalars = tuple(s_ref[i] for i in range(s_ref.shape[0]))
  results = body(scalars, *(r[...].astype(jnp.float32) for r in ins))
  for ref, val in zip(outs, results):
    ref[...] = val.astype(ref.dtype)
