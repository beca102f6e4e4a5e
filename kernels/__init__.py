"""Pallas kernels for GRPO, each beside its pure-JAX reference.

Public ops: :func:`grpo_loss`. Targets and lowering: :mod:`kernels.backend`.
"""

from kernels.grpo_loss import GRPOAux, LossBlocks, grpo_loss, grpo_loss_reference

__all__ = ["grpo_loss", "grpo_loss_reference", "GRPOAux", "LossBlocks"]
