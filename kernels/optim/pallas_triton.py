"""Multi-tensor apply: one Pallas launch updates every leaf of a parameter tree (GPU / Triton family).

Design. Each program owns one (leaf, chunk) pair: ``chunk`` consecutive elements of one leaf, walked in
``block``-element steps with masked 128-bit loads and stores (PyTorch / apex multi-tensor apply: fixed
chunks, a program -> (tensor, chunk) map). The leaves stay where they are — every leaf's param, grad
and state buffers are operands of the one call and the outputs alias them (``input_output_aliases``),
so nothing is concatenated or copied (with donated buffers), and each element is read once and written
once: 7 words per f32 parameter for AdamW, 5 for Lion and SGD. The map from program id to (leaf,
chunk) is static (shapes are static), so it is compiled into the kernel as a balanced tree of scalar
comparisons against the leaves' first program ids (depth ceil(log2 leaves): 9 for the 0.5B tree's
290 leaves, no table load); each leaf is one branch, so leaves of different dtypes, with or without an
f32 master, with or without weight decay (the mask), share the launch.

Why not flat buffers kept across steps: the model reads the tree, and the backward pass writes one
gradient buffer per leaf; a flat layout costs a gather of gradients into the flat buffer (2 extra
words per parameter) or slices of it for the model, every step, and it would change the state layout
that rl/update.py shards like the params. The (leaf, chunk) walk needs neither.

Launches: one per tree (per device under shard_map, see transform.py), split only where the operands
would overflow CUDA's kernel parameter space (32,764 bytes from CUDA 12.1 on sm_70+, 8 bytes per
buffer pointer: ``MAX_POINTERS``); AdamW on the 0.5B / 1.5B trees is 2,030 / 2,366 pointers (16-19
KB), one launch each. See :mod:`kernels.optim.pallas_triton_evidence` for programs, bytes and occupancy.

The TPU (tiled) family has its own one-launch walk (kernels/optim/pallas_tpu.py): (leaf, window) items
DMA'd through VMEM, each leaf in its own tiled layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend
from kernels.backend import Target
from kernels.optim.pallas_blocks import MultiTensorBlocks, default_blocks
from kernels.optim.work import LeafWork, split_empty

# 32,764 bytes of kernel parameters (CUDA >= 12.1 on sm_70+), 8 bytes per pointer, minus headroom for
# the scalar operand and Triton's own arguments.
MAX_POINTERS = 4000
# The H100 SXM register file and thread limits (per SM), for the occupancy estimate and the check.
REGS_PER_SM, THREADS_PER_SM, CTAS_PER_SM = 65536, 2048, 32


def multi_tensor_call(
  work: Sequence[LeafWork],
  scalars,  # f32 [k]
  *,
  target: Target,
  blocks: MultiTensorBlocks | None = None,
  in_place: bool = False,
  name: str = "multi_tensor",
) -> list[dict[str, jax.Array]]:
  """Every leaf of ``work`` in one launch (more only past ``MAX_POINTERS``). ``in_place``: an output
  named like an input of its dtype reuses that input's buffer. Returns each leaf's outputs, named."""
  blocks = blocks or default_blocks()
  results, live = split_empty(work)
  for group in _pointer_groups([work[i] for i in live]):
    outs = _launch([work[live[j]] for j in group], scalars, target, blocks, in_place, name)
    for j, out in zip(group, outs):
      results[live[j]] = out
  return results


def _pointer_groups(work: Sequence[LeafWork]) -> list[list[int]]:
  """Consecutive leaves per launch, each launch at most MAX_POINTERS buffers."""
  groups, current, used = [], [], 0
  for i, w in enumerate(work):
    need = len(w.inputs) + len(w.outputs)
    if current and used + need > MAX_POINTERS:
      groups.append(current)
      current, used = [], 0
    current.append(i)
    used += need
  return groups + [current] if current else groups


def program_starts(sizes: Sequence[int], chunk: int) -> list[int]:
  """First program id of each leaf (and the total at the end): leaf i owns programs
  [starts[i], starts[i + 1]), chunk elements each."""
  starts = [0]
  for n in sizes:
    starts.append(starts[-1] + -(-n // chunk))
  return starts


def _launch(work, scalars, target, blocks, in_place, name):
  sizes = [math.prod(next(iter(w.inputs.values())).shape) for w in work]
  if max(sizes) > 2**31 - 1 - blocks.chunk:
    raise ValueError(f"a leaf of {max(sizes)} elements overflows int32 element offsets")
  starts = program_starts(sizes, blocks.chunk)
  operands, out_shape, aliases, layout = [], [], {}, []
  for w, n in zip(work, sizes):
    in_base, out_base = len(operands), len(out_shape)
    names = list(w.inputs)
    for k, dtype in w.outputs.items():
      if in_place and k in w.inputs and w.inputs[k].dtype == dtype:
        aliases[1 + in_base + names.index(k)] = len(out_shape)  # scalars are operand 0
      out_shape.append(jax.ShapeDtypeStruct((n,), dtype))
    operands += [a.reshape(n) for a in w.inputs.values()]
    layout.append((w.body, n, in_base, len(w.inputs), out_base, len(w.outputs)))
  kernel = functools.partial(
    _kernel, layout=tuple(layout), starts=tuple(starts), n_in=len(operands), blocks=blocks
  )
  outs = pl.pallas_call(
    kernel,
    grid=(starts[-1],),
    in_specs=[pl.BlockSpec(scalars.shape, lambda i: (0,))]
    + [pl.BlockSpec((a.shape[0],), lambda i: (0,)) for a in operands],
    out_specs=[pl.BlockSpec(s.shape, lambda i: (0,)) for s in out_shape],
    out_shape=out_shape,
    input_output_aliases=aliases,
    compiler_params=backend.compiler_params(target, num_warps=blocks.num_warps, num_stages=1),
    interpret=target.interpret,
    name=name,
  )(scalars, *operands)
  shaped = []
  for w, (_, _, _, _, out_base, _) in zip(work, layout):
    shape = next(iter(w.inputs.values())).shape
    shaped.append({k: outs[out_base + j].reshape(shape) for j, k in enumerate(w.outputs)})
  return shaped


def _kernel(s_ref, *refs, layout, starts, n_in, blocks: MultiTensorBlocks):
  ins_all, outs_all = refs[:n_in], refs[n_in:]
  scalars = tuple(s_ref[k] for k in range(s_ref.shape[0]))
  pid = pl.program_id(0)

  def leaf(i):
    body, n, in_base, n_ins, out_base, n_outs = layout[i]
    ins, outs = ins_all[in_base : in_base + n_ins], outs_all[out_base : out_base + n_outs]
    base = (pid - starts[i]) * blocks.chunk  # first element of this program's chunk

    def step(s, carry):
      start = pl.multiple_of(base + s * blocks.block, blocks.block)
      valid = start + jnp.arange(blocks.block, dtype=jnp.int32) < n
      window = pl.ds(start, blocks.block)
      vals = [
        backend.masked_load(r.at[window], mask=valid, other=0.0).astype(jnp.float32) for r in ins
      ]
      for ref, val in zip(outs, body(scalars, *vals)):
        backend.masked_store(ref.at[window], val.astype(ref.dtype), mask=valid)
      return carry

    def run():
      if blocks.steps == 1:
        step(0, 0)
      else:
        jax.lax.fori_loop(0, blocks.steps, step, 0)

    return run

  _dispatch(pid, starts, leaf, 0, len(layout))


def _dispatch(pid, starts, leaf, lo: int, hi: int):
  """Run leaf(i)() for the leaf i in [lo, hi) that owns program ``pid``: a balanced tree of
  ``pid < starts[mid]`` comparisons, ceil(log2(hi - lo)) deep."""
  if hi - lo == 1:
    leaf(lo)()
    return
  mid = (lo + hi) // 2
  jax.lax.cond(
    pid < starts[mid],
    lambda: _dispatch(pid, starts, leaf, lo, mid),
    lambda: _dispatch(pid, starts, leaf, mid, hi),
  )
