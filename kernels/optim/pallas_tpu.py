"""Multi-tensor apply for the tiled family (Mosaic TPU, and the CPU interpreter of it): ONE launch
updates every leaf of a tree, each leaf in its own shape and layout.

Why this shape. A TPU array [..., R, C] is stored in (8, 128) tiles of its last two dims, so viewing a
leaf as anything else (a flat [n / 2048, 2048] view, a concatenation) is a relayout copy in HBM. The
per-leaf kernel this replaces paid exactly that: 290 launches and 1,183 reshapes around them for the
Qwen2.5-0.5B tree, 58.35 GB accessed against the 13.83 GB AdamW must move (compiled, v6e). Here
every leaf's param, grad and state buffers are operands of one ``pallas_call`` left in HBM
(``pltpu.HBM``: with ``pl.ANY`` XLA may place a small leaf in VMEM, where Mosaic slices only whole
tiles), the outputs alias them, and the kernel DMAs (h, w) windows of each leaf's own (R, C) plane —
a contiguous run of rows of its tiles — into VMEM, updates them there and DMAs them back: 7 words
per AdamW parameter and nothing else (5 for Lion and SGD). Compiled for that tree: one launch,
13.83 GB on v6e and v4 (1.000x; Lion / SGD 9.88 GB) — a custom call is opaque to XLA's cost
analysis, so the kernel declares its bytes (``pl.CostEstimate``: exactly its DMAs) and the rest is
XLA's count of everything around it (bitcasts and a few scalars).

Flat optimizer state kept across steps was the alternative: params and grads would still be per
leaf (the model reads and the backward pass writes them so), so the kernel walks leaves anyway, and
the state would stop being shaped and sharded like the params (rl/update.py shards it so).

The plan (:mod:`kernels.optim.pallas_tpu_plan`): (leaf, window) work items in leaf order, grouped in segments
of one window shape; windows of one width, dtypes and rule share a class of VMEM buffers ``SLOTS``
deep, sized so all classes take <= 3/4 of ``target.vmem_bytes`` (v4: 12 of 16 MiB). The walk
(:mod:`kernels.optim.pallas_tpu_walk`): pipelined DMAs, the math per class on strips. Megacore parts (v4, v5p:
two TensorCores per device) split the items in two halves of equal bytes over a ``parallel`` grid
of 2. The GPU (Triton) family's launch is :mod:`kernels.optim.pallas_triton`.
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
from kernels.optim import pallas_tpu_plan, pallas_tpu_walk
from kernels.optim.pallas_blocks import ElementwiseBlocks
from kernels.optim.work import LeafWork, split_empty

SLOTS = 3


def cores_of(target: Target) -> int:
  """TensorCores one device drives: 2 on megacore parts (v4, v5p) and when unknown (a plain "tpu"
  target must run well everywhere; on one core the two halves just run one after the other); 1 in
  the interpreter (a second grid step there is compile time only; tests split explicitly)."""
  if target.interpret:
    return 1
  gen = target.tpu
  return 2 if gen is None else gen.cores_per_chip // gen.devices_per_chip


def plan_for(
  work: Sequence[LeafWork], target: Target, blocks: ElementwiseBlocks | None, cores: int
):
  """The tiles plan of ``work`` (non-empty leaves) for ``target``."""
  specs = [
    pallas_tpu_plan.LeafSpec(
      _operand_shape(next(iter(w.inputs.values())).shape),  # the shape the kernel is handed
      tuple(a.dtype for a in w.inputs.values()),
      tuple(jnp.dtype(d) for d in w.outputs.values()),
      w.key if w.key is not None else i,
    )
    for i, w in enumerate(work)
  ]
  kw = {}
  if blocks is not None:
    kw = dict(tile_elems=blocks.block_rows * blocks.block_cols, max_cols=blocks.block_cols)
  return pallas_tpu_plan.make_plan(
    specs, vmem_budget=target.vmem_bytes * 3 // 4, cores=cores, slots=SLOTS, **kw
  )


def multi_tensor_call(
  work: Sequence[LeafWork],
  scalars,  # f32 [k]
  *,
  target: Target,
  blocks: ElementwiseBlocks | None = None,
  in_place: bool = False,
  name: str = "multi_tensor",
  interpret=None,
  cores: int | None = None,
) -> list[dict[str, jax.Array]]:
  """Every leaf of ``work`` in one launch. ``in_place``: an output named like an input of its dtype
  reuses that input's buffer (donate it, or XLA copies it first). Returns each leaf's outputs.
  ``interpret`` (tests): a ``pltpu.InterpretParams`` runs the pipelined walk in the TPU interpreter
  (None: ``target.interpret``); ``cores``: split the items over this many grid steps."""
  if target.family != "tiled":
    raise ValueError(f"the tiled multi-tensor kernel needs a tiled-family target, got {target}")
  results, live = split_empty(work)
  if live:
    interpret = target.interpret if interpret is None else interpret
    cores = cores_of(target) if cores is None else cores
    outs = _launch([work[i] for i in live], scalars, target, blocks, in_place, name, interpret, cores)  # fmt: skip
    for i, out in zip(live, outs):
      results[i] = out
  return results


def _operand_shape(shape) -> tuple[int, ...]:
  """What the kernel is handed: the leaf itself; a 0-d / 1-D leaf as [1, n] and rank > 3 with its
  leading dims merged (dims above the tiled two)."""
  if len(shape) <= 1:
    n = max(1, math.prod(shape))
    return (n // 128, 128) if n % 128 == 0 and n > 128 else (1, n)
  if len(shape) > 3:
    return (math.prod(shape[:-2]), *shape[-2:])
  return tuple(shape)


def _launch(work, scalars, target, blocks, in_place, name, interpret, cores):
  plan = plan_for(work, target, blocks, cores)
  operands, out_shape, aliases, io = [], [], {}, []
  for w in work:
    shape = next(iter(w.inputs.values())).shape
    op_shape = _operand_shape(shape)
    in_base, out_base = len(operands), len(out_shape)
    names = list(w.inputs)
    for k, dtype in w.outputs.items():
      if in_place and k in w.inputs and w.inputs[k].dtype == dtype:
        aliases[1 + in_base + names.index(k)] = len(out_shape)  # scalars are operand 0
      out_shape.append(jax.ShapeDtypeStruct(op_shape, dtype))
    operands += [a.reshape(op_shape) if a.shape != op_shape else a for a in w.inputs.values()]
    io.append((in_base, len(w.inputs), out_base, len(w.outputs)))
  sync = (
    interpret is True
  )  # the plain interpreter: the synchronous walk (see kernels.optim.pallas_tpu_walk)
  slots = 1 if sync else plan.slots
  scratch = [backend.scratch_vmem((slots, *c.tile), d) for c in plan.classes for d in c.buffers]
  if not sync:
    dma = backend._tpu_module().SemaphoreType.DMA
    scratch += [dma((slots, max(n for _, n, _, _ in io))), dma((slots, max(n for *_, n in io)))]
  kernel = functools.partial(
    pallas_tpu_walk.kernel,
    plan=plan,
    io=tuple(io),
    bodies=tuple(work[c.leader].body for c in plan.classes),
    n_in=len(operands),
    n_out=len(out_shape),
    sync=sync,
  )
  # HBM, not ANY: XLA would place small leaves in VMEM, where Mosaic slices only whole tiles
  hbm = pl.BlockSpec(memory_space=backend._tpu_module().HBM)
  outs = pl.pallas_call(
    kernel,
    grid=(len(plan.splits) - 1,),
    in_specs=[pl.BlockSpec(memory_space=backend.tpu_smem())] + [hbm] * len(operands),
    out_specs=[hbm] * len(out_shape),
    out_shape=out_shape,
    scratch_shapes=scratch,
    input_output_aliases=aliases,
    compiler_params=backend.compiler_params(
      target,
      dimension_semantics=("parallel",),
      vmem_limit_bytes=min(target.vmem_bytes, plan.vmem_bytes() + (4 << 20)),
    ),
    interpret=interpret,
    cost_estimate=_cost(work, scalars),
    name=name,
  )(scalars, *operands)
  shaped = []
  for w, (_, _, out_base, _) in zip(work, io):
    shape = next(iter(w.inputs.values())).shape
    shaped.append({k: outs[out_base + j].reshape(shape) for j, k in enumerate(w.outputs)})
  return shaped


def _cost(work, scalars) -> pl.CostEstimate:
  """What the kernel tells XLA's cost model (a custom call is opaque to it): the bytes are exactly
  its DMAs (every input element read once, every output written once); flops and transcendentals
  are the body's element-wise operations (counted in its jaxpr, once per body key) per element."""
  nbytes, flops, trans, per_key = 0, 0, 0, {}
  one = jax.ShapeDtypeStruct((), jnp.float32)
  for i, w in enumerate(work):
    n = math.prod(next(iter(w.inputs.values())).shape)
    nbytes += n * sum(a.dtype.itemsize for a in w.inputs.values())
    nbytes += n * sum(jnp.dtype(d).itemsize for d in w.outputs.values())
    key = w.key if w.key is not None else ("leaf", i)
    if key not in per_key:
      s = (one,) * scalars.shape[0]
      eqns = jax.make_jaxpr(w.body)(s, *(one for _ in w.inputs)).eqns
      per_key[key] = len(eqns), sum(e.primitive.name in TRANSCENDENTAL for e in eqns)
    flops += n * per_key[key][0]
    trans += n * per_key[key][1]
  return pl.CostEstimate(flops=flops, transcendentals=trans, bytes_accessed=nbytes)


TRANSCENDENTAL = frozenset({"sqrt", "rsqrt", "exp", "exp2", "log", "log1p", "tanh", "logistic"})
