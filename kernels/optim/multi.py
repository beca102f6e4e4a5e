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
KB), one launch each. See :mod:`kernels.optim.evidence` for programs, bytes and occupancy.

The TPU (tiled) family has its own one-launch walk (kernels/optim/pallas.py): (leaf, window) items
DMA'd through VMEM, each leaf in its own tiled layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend
from kernels.backend import Target

# 32,764 bytes of kernel parameters (CUDA >= 12.1 on sm_70+), 8 bytes per pointer, minus headroom for
# the scalar operand and Triton's own arguments.
MAX_POINTERS = 4000
# The H100 SXM register file and thread limits (per SM), for the occupancy estimate and the check.
REGS_PER_SM, THREADS_PER_SM, CTAS_PER_SM = 65536, 2048, 32


@dataclasses.dataclass(frozen=True)
class MultiTensorBlocks:
  """block: elements per step (a power of two, 128..16384); chunk: elements per program, a multiple
  of block (at most 64 steps); num_warps: 1, 2, 4, 8 or 16. Elements per thread per array =
  block / (32 num_warps), at most 64 (the registers a step keeps live)."""

  block: int = 1024
  chunk: int = 4096
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block", "chunk", "num_warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MultiTensorBlocks.{name} must be a positive int, got {value!r}")
    if self.block & (self.block - 1) or not 128 <= self.block <= 16384:
      raise ValueError(
        f"MultiTensorBlocks.block must be a power of two in [128, 16384], got {self.block}"
      )
    if self.chunk % self.block or not 1 <= self.chunk // self.block <= 64:
      raise ValueError(
        f"MultiTensorBlocks.chunk must be block x (1..64), got chunk={self.chunk}, block={self.block}"
      )
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(
        f"MultiTensorBlocks.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}"
      )
    if self.per_thread > 64:
      raise ValueError(
        f"MultiTensorBlocks: block / (32 num_warps) = {self.per_thread} elements per thread per "
        "array; at most 64 (registers)"
      )

  @property
  def per_thread(self) -> int:
    return max(1, self.block // (32 * self.num_warps))

  @property
  def steps(self) -> int:
    return self.chunk // self.block


def default_blocks(n_inputs: int = 4) -> MultiTensorBlocks:
  """1024-element steps on 4 warps: 8 f32 per thread per array (two 128-bit accesses), so AdamW's
  four input arrays keep 32 loaded values live — a modest ~64 registers, 8 resident programs per SM —
  and 4 steps per program (4096 elements) so the 0.5B tree is ~121K programs, not ~480K."""
  del n_inputs  # one heuristic serves 2-5 input arrays (see kernels.optim.evidence)
  return MultiTensorBlocks(1024, 4096, 4)


def candidate_blocks(n_inputs: int = 4, n_outputs: int = 3) -> list[MultiTensorBlocks]:
  """The autotuner's grid for the multi-tensor step (heuristic first): steps of 512-4096 elements,
  1 or 4 steps per program, 4 or 8 warps, keeping the estimated registers per thread <= 128 for
  ``n_inputs`` f32 input arrays (``n_outputs`` is accepted for the tuner's symmetry with the bytes)."""
  if not 1 <= n_inputs <= 8 or not 1 <= n_outputs <= 8:
    raise ValueError(f"n_inputs and n_outputs must be in [1, 8], got {n_inputs}, {n_outputs}")
  first = default_blocks(n_inputs)
  out = [first]
  for block in (512, 1024, 2048, 4096):
    for steps in (1, 4):
      for warps in (4, 8):
        b = MultiTensorBlocks(block, block * steps, warps)
        if b != first and estimated_registers(b, n_inputs) <= 128:
          out.append(b)
  return out


def estimated_registers(blocks: MultiTensorBlocks, n_inputs: int) -> int:
  """Registers per thread: the loaded values of every input array live at once (the math reads them
  all before the stores), plus ~32 for addresses, masks, scalars and loop state."""
  return n_inputs * blocks.per_thread + 32


class LeafWork(NamedTuple):
  """One leaf's part of a launch: ``body(scalars, *f32 [block] inputs) -> f32 [block] outputs``;
  inputs: name -> [...] array (one shape); outputs: name -> dtype, in the order body returns them;
  key: leaves with equal keys have interchangeable bodies (None: this leaf's own)."""

  body: Callable
  inputs: dict[str, jax.Array]
  outputs: dict[str, Any]
  key: Hashable = None


def split_empty(work: Sequence[LeafWork]) -> tuple[list[dict | None], list[int]]:
  """(results with an empty leaf's outputs filled in — zero-size arrays: nothing to walk, no
  program —, the indices of the leaves a launch must walk)."""
  results: list[dict | None] = [None] * len(work)
  live = []
  for i, w in enumerate(work):
    shape = next(iter(w.inputs.values())).shape
    if math.prod(shape) == 0:
      results[i] = {k: jnp.zeros(shape, d) for k, d in w.outputs.items()}
    else:
      live.append(i)
  return results, live


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
