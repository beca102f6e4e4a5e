"""The optimizers' implementations: the op's one table (:class:`kernels.ops.Op`), and how
:func:`kernels.optim.leaf.update_leaves` calls each (``Impl.run(works, scalars, target, blocks,
write, name)`` -> each leaf's outputs, named).

  xla     the pure-JAX reference (:mod:`.reference`): the same body on whole f32 arrays
  pallas  one multi-tensor launch for the tree (:mod:`.pallas`): the Mosaic (leaf, window) walk on
          the tiled family (:mod:`.pallas_tpu`; TPU, CPU interpreter; blocks ``ElementwiseBlocks``),
          the Triton (leaf, chunk) walk on GPU (:mod:`.pallas_triton`; ``MultiTensorBlocks``)

``impl="auto"``: the tuned cache's choice, else xla on CPU and pallas on GPU and TPU. The tuner's
shape is (rule, param dtype, total parameters) of one tree.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels import ops
from kernels.backend import Target
from kernels.optim import pallas, pallas_blocks, pallas_tpu, pallas_triton, reference, rules

RULES = {cls.__name__.lower(): cls for cls in (rules.AdamW, rules.Lion, rules.SGD)}


def _arrays(rule: str) -> tuple[int, int]:
  """(arrays read, arrays written) per parameter of ``rule``: param, grad and its state in; the
  param and its state out."""
  slots = len(RULES[rule].slots)
  return 2 + slots, 1 + slots


def _run_reference(works, scalars, target, blocks, write, name):
  del target, blocks, write, name
  return [reference.elementwise_reference(w.body, w.inputs, w.outputs, scalars) for w in works]


def _run_pallas(works, scalars, target, blocks, write, name):
  if not works:
    return []
  stacked = jnp.stack(scalars).astype(jnp.float32) if scalars else jnp.zeros([1], jnp.float32)
  return pallas.multi_tensor_call(
    works, stacked, target=target, blocks=blocks, in_place=write == "param", name=name
  )


def _family_blocks(target: Target) -> type:
  """The blocks class of ``target``'s kernel family."""
  rowloop = target.family == "rowloop"
  return pallas_blocks.MultiTensorBlocks if rowloop else pallas_blocks.ElementwiseBlocks


def _supported_on(target: Target, shape: dict, blocks) -> str | None:
  """Blocks of the other kernel family (tiles on the GPU's walk, or the reverse): why not."""
  want = _family_blocks(target)
  if blocks is not None and not isinstance(blocks, want):
    return f"tuned blocks {blocks!r} are not {want.__name__} ({target.family} target)"
  return None


def _heuristic(target: Target, shape: dict):
  """The GPU walk's blocks; the tiled family sizes its windows from the target's VMEM (None)."""
  return pallas_blocks.default_blocks(_arrays(shape["rule"])[0]) if target.family == "rowloop" else None  # fmt: skip


def _candidates(shape: dict, platform: str) -> list:
  """GPU: the multi-tensor launch's grid (heuristic first); TPU / CPU: the heuristic."""
  if platform == "gpu":
    return pallas_blocks.candidate_blocks(*_arrays(shape["rule"]))
  return [None]


def bucket(shape: dict) -> str:
  """The tuning cache's key: a whole parameter tree per rule, its size (rounded up to a power of
  two) deciding launch count vs bandwidth."""
  return f"{shape['rule']}/{shape['dtype']}/p{ops.pow2(shape['params'])}"


IMPLEMENTATIONS = {
  "pallas": ops.Impl(
    modules=(pallas, pallas_tpu, pallas_triton),
    blocks=(pallas_blocks.ElementwiseBlocks, pallas_blocks.MultiTensorBlocks),
    heuristic=_heuristic,
    candidates=_candidates,
    supported_on=_supported_on,
    run=_run_pallas,
  ),
  "xla": ops.Impl(modules=(reference,), run=_run_reference),
}

OP = ops.Op("optim", IMPLEMENTATIONS, bucket, auto=dict(cpu="xla", gpu="pallas", tpu="pallas"))
