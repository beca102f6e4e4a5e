"""What both Mosaic GPU loss kernel families need: the row kernels (:mod:`kernels.grpo_loss.mosaic_gpu`)
and the cluster-split kernels (:mod:`kernels.grpo_loss.mosaic_cluster`), which the row module
dispatches to. Kept here so that neither imports the other's module to get them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp

from kernels.backend import Target

if TYPE_CHECKING:  # annotations only: both modules import this one
  from kernels.grpo_loss.mosaic_cluster import ClusterLossBlocks
  from kernels.grpo_loss.mosaic_gpu import MosaicLossBlocks

SMEM_BUDGET = 200 * 1024  # bytes of the H100's 227 KiB of shared memory the rings may use


@dataclasses.dataclass(frozen=True)
class MosaicLossConfig:
  target: Target
  blocks: MosaicLossBlocks | ClusterLossBlocks  # the row kernels' tiles or the cluster-split shape
  vocab: int  # the real vocabulary; columns at or past it are padding
  temperature: float


def pad_to(x, n, v):
  """x [N(, V)] zero-padded to [n(, v)] (no copy when it already has that shape)."""
  pad = ((0, n - x.shape[0]),) + (((0, v - x.shape[1]),) if x.ndim == 2 else ())
  return x if all(p == (0, 0) for p in pad) else jnp.pad(x, pad)
