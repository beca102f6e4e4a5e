"""Pallas kernels for GRPO, each beside its pure-JAX reference.

Public ops (the policy loss described by one :class:`LossSpec`): :func:`grpo_loss`, :func:`fused_linear_grpo_loss`, :func:`paged_attention`,
:func:`adamw_update`, :func:`lion_update`, :func:`sgd_update`, :func:`fused_adamw`, :func:`fused_lion`,
:func:`fused_sgd` (optimizers: :mod:`kernels.optim`). Targets and lowering: :mod:`kernels.backend`.
Each op declares its implementations in one table (``kernels.<op>.impls.OP``, the protocol of
:mod:`kernels.ops`; docs/ops.md), which its ``impl=`` argument, ``impl="auto"`` and the autotuner read.
"""

from kernels import optim
from kernels.fused_linear import (
  LinearBlocks,
  MosaicLinearBlocks,
  fused_linear_grpo_loss,
  fused_linear_grpo_loss_reference,
)
from kernels.grpo_loss import GRPOAux, LossBlocks, grpo_loss, grpo_loss_reference
from kernels.loss_spec import LossSpec
from kernels.optim import (
  adamw_update,
  fused_adamw,
  fused_adamw_step,
  fused_lion,
  fused_lion_step,
  fused_sgd,
  fused_sgd_step,
  lion_update,
  sgd_update,
)
from kernels.paged_attention import PagedBlocks, paged_attention, paged_attention_reference

__all__ = [
  "GRPOAux",
  "LinearBlocks",
  "LossBlocks",
  "LossSpec",
  "MosaicLinearBlocks",
  "PagedBlocks",
  "adamw_update",
  "fused_adamw",
  "fused_adamw_step",
  "fused_linear_grpo_loss",
  "fused_linear_grpo_loss_reference",
  "fused_lion",
  "fused_lion_step",
  "fused_sgd",
  "fused_sgd_step",
  "grpo_loss",
  "grpo_loss_reference",
  "lion_update",
  "optim",
  "paged_attention",
  "paged_attention_reference",
  "sgd_update",
]
