"""The optimizers' ``pallas`` impl: one multi-tensor launch for a whole tree, by the target's family.

  tiled   (TPU, CPU interpreter): :mod:`kernels.optim.pallas_tpu` (its plan
                                  :mod:`kernels.optim.pallas_tpu_plan`, its body
                                  :mod:`kernels.optim.pallas_tpu_walk`)
  rowloop (GPU / Triton):         :mod:`kernels.optim.pallas_triton`

Each family takes its own blocks (:mod:`kernels.optim.pallas_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from kernels.backend import Target
from kernels.optim import pallas_tpu, pallas_triton
from kernels.optim.pallas_blocks import ElementwiseBlocks, MultiTensorBlocks
from kernels.optim.work import LeafWork


def multi_tensor_call(
  works: Sequence[LeafWork],
  stacked,  # f32 [k] the rule's scalars
  *,
  target: Target,
  blocks: ElementwiseBlocks | MultiTensorBlocks | None,
  in_place: bool,
  name: str,
) -> list[dict[str, jax.Array]]:
  """One multi-tensor launch for the whole tree: the Triton (leaf, chunk) walk on the GPU family
  (:mod:`kernels.optim.pallas_triton`), the Mosaic (leaf, window) walk on the tiled one
  (:mod:`kernels.optim.pallas_tpu`)."""
  family = MultiTensorBlocks if target.family == "rowloop" else ElementwiseBlocks
  if blocks is not None and not isinstance(blocks, family):
    raise TypeError(
      f"blocks for the {target.family} kernel must be {family.__name__}, got {blocks!r}"
    )
  kernel = pallas_triton if target.family == "rowloop" else pallas_tpu
  return kernel.multi_tensor_call(
    works, stacked, target=target, blocks=blocks, in_place=in_place, name=name
  )
