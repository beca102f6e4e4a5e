"""Fused element-wise optimizers (AdamW, Lion, SGD with momentum), shaped like optax.

Three layers, each a thin one over the next:
  rules.py      an optimizer's element-wise math, once: ``AdamW`` / ``Lion`` / ``SGD`` (frozen
                dataclasses of validated hyperparameters with ``delta(p, g, scalars, *slots)``);
  leaf.py       a rule on arrays: ``update_leaves`` runs every leaf of a tree in one pass over memory
                (param, grad and state read once, new param and state written once: 7 x 4 bytes per
                f32 parameter for AdamW) in ONE launch for the whole tree, leaves aliased in place,
                through the op's table (impls.py): the ``pallas`` impl (pallas.py) is a Triton
                (leaf, chunk) walk on GPU (pallas_triton.py) and a Mosaic (leaf, window) walk over
                each leaf in its own tiled layout on TPU (pallas_tpu.py launches it,
                pallas_tpu_plan.py plans it, pallas_tpu_walk.py is its body), ``xla`` the pure-JAX
                reference (reference.py), all evaluating the same body (work.py's ``LeafWork``);
  transform.py  a rule over a tree: an ``optax.GradientTransformation`` returning the update delta,
                and an in-place ``step(params, grads, state)``, optionally shard-local on a mesh
                (one shard_map, one launch per device).
The GPU launch's programs, bytes and occupancy against the H100 (no GPU needed):
pallas_triton_evidence.py; both families' blocks: pallas_blocks.py.
The public functions below name the combinations: ``fused_adamw(...)`` is ``fused(AdamW(...), ...)``.
A new element-wise optimizer is one ``Rule`` subclass (``SGD``: 13 lines, its math 4).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from kernels.optim.impls import IMPLEMENTATIONS, OP
from kernels.optim.leaf import KernelOptions, RuleUpdate, apply_rule, update_leaves
from kernels.optim.pallas_blocks import (
  ElementwiseBlocks,
  MultiTensorBlocks,
  candidate_blocks,
  default_blocks,
)
from kernels.optim.rules import SGD, AdamW, Interval, Lion, Rule, check_range
from kernels.optim.transform import FusedOptimizer, FusedState, partition_specs_of

__all__ = [
  "IMPLEMENTATIONS",
  "OP",
  "SGD",
  "AdamW",
  "AdamWUpdate",
  "ElementwiseBlocks",
  "FusedOptimizer",
  "FusedState",
  "Interval",
  "KernelOptions",
  "Lion",
  "LionUpdate",
  "MultiTensorBlocks",
  "Rule",
  "RuleUpdate",
  "SGDUpdate",
  "adamw_update",
  "apply_rule",
  "candidate_blocks",
  "check_range",
  "default_blocks",
  "fused",
  "fused_adamw",
  "fused_adamw_step",
  "fused_lion",
  "fused_lion_step",
  "fused_optimizer",
  "fused_sgd",
  "fused_sgd_step",
  "fused_step",
  "lion_update",
  "partition_specs_of",
  "sgd_update",
  "update_leaves",
]


# --------------------------------------------------------------------------- a rule over a tree
def fused_optimizer(
  rule: Rule,
  learning_rate,
  *,
  mask=None,
  mesh=None,
  partition_specs=None,
  impl: str = "auto",
  platform=None,
  interpret=None,
  blocks: ElementwiseBlocks | MultiTensorBlocks | None = None,
) -> FusedOptimizer:
  """``rule`` over a parameter tree. learning_rate: float >= 0 or optax schedule; mask: pytree of
  bools or callable(params), the leaves that get weight decay; mesh + partition_specs (see
  :func:`partition_specs_of`): each leaf updated on its local shard under shard_map; impl:
  "pallas" | "xla" | "auto" (kernel on TPU / GPU, XLA on CPU); platform / interpret: the target."""
  options = KernelOptions(impl, platform, interpret, blocks)
  return FusedOptimizer(rule, learning_rate, mask, mesh, partition_specs, options)


def fused(rule: Rule, learning_rate, **options) -> optax.GradientTransformation:
  """``rule`` as an optax transformation: ``update(updates, state, params)`` returns the delta that
  ``optax.apply_updates`` adds (AdamW: 10 x 4 bytes per f32 parameter). Options: as
  :func:`fused_optimizer`."""
  return fused_optimizer(rule, learning_rate, **options).transformation()


def fused_step(rule: Rule, learning_rate, **options):
  """``(tx, step)``: :func:`fused`'s transformation and an in-place ``step(params, grads, state) ->
  (new_params, new_state)`` writing the parameters directly (AdamW: 7 x 4 bytes, the minimum; donate
  params and state to ``jax.jit`` so the aliased buffers are reused)."""
  opt = fused_optimizer(rule, learning_rate, **options)
  return opt.transformation(), opt.step


def fused_adamw(
  learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, **options
) -> optax.GradientTransformation:
  """``optax.adamw`` as one fused pass over the tree; see :func:`fused`."""
  return fused(AdamW(b1, b2, eps, weight_decay), learning_rate, **options)


def fused_adamw_step(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, **options):
  """``(tx, step)`` for AdamW; see :func:`fused_step`."""
  return fused_step(AdamW(b1, b2, eps, weight_decay), learning_rate, **options)


def fused_lion(
  learning_rate, b1=0.9, b2=0.99, weight_decay=1e-3, **options
) -> optax.GradientTransformation:
  """``optax.lion`` as one fused pass over the tree; see :func:`fused`."""
  return fused(Lion(b1, b2, weight_decay), learning_rate, **options)


def fused_lion_step(learning_rate, b1=0.9, b2=0.99, weight_decay=1e-3, **options):
  """``(tx, step)`` for Lion; see :func:`fused_step`."""
  return fused_step(Lion(b1, b2, weight_decay), learning_rate, **options)


def fused_sgd(
  learning_rate, momentum=0.9, nesterov=False, **options
) -> optax.GradientTransformation:
  """``optax.sgd(learning_rate, momentum, nesterov)`` as one fused pass over the tree."""
  return fused(SGD(momentum, nesterov), learning_rate, **options)


def fused_sgd_step(learning_rate, momentum=0.9, nesterov=False, **options):
  """``(tx, step)`` for SGD with momentum; see :func:`fused_step`."""
  return fused_step(SGD(momentum, nesterov), learning_rate, **options)


# --------------------------------------------------------------------------- a rule on one array
class AdamWUpdate(NamedTuple):
  param: jax.Array  # [...] new parameter (param dtype)
  mu: jax.Array  # [...] f32
  nu: jax.Array  # [...] f32
  master: jax.Array | None  # [...] f32 new master copy, when one was given


class LionUpdate(NamedTuple):
  param: jax.Array
  mu: jax.Array
  master: jax.Array | None


class SGDUpdate(NamedTuple):
  param: jax.Array
  trace: jax.Array
  master: jax.Array | None


def adamw_update(
  param,  # [...] bf16 / f32
  grad,  # [...] float
  mu,  # [...] f32
  nu,  # [...] f32
  count,  # int [], steps already taken (optax's state.count)
  *,
  lr,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  master=None,  # [...] f32
  impl: str = "auto",
  platform=None,
  interpret=None,
  blocks: ElementwiseBlocks | MultiTensorBlocks | None = None,
) -> AdamWUpdate:
  """One AdamW step on one array, exactly as ``optax.adamw`` then ``optax.apply_updates``; see
  :func:`apply_rule` (master copy, in-place buffers, range checks)."""
  options = KernelOptions(impl, platform, interpret, blocks)
  rule = AdamW(b1, b2, eps, weight_decay)
  out = apply_rule(rule, param, grad, (mu, nu), count, lr=lr, master=master, options=options)
  return AdamWUpdate(out.param, *out.slots, out.master)


def lion_update(
  param,  # [...] bf16 / f32
  grad,  # [...] float
  mu,  # [...] f32
  *,
  lr,
  b1: float = 0.9,
  b2: float = 0.99,
  weight_decay: float = 1e-3,
  master=None,  # [...] f32
  impl: str = "auto",
  platform=None,
  interpret=None,
  blocks: ElementwiseBlocks | MultiTensorBlocks | None = None,
) -> LionUpdate:
  """One Lion step on one array, exactly as ``optax.lion`` then ``optax.apply_updates``."""
  options = KernelOptions(impl, platform, interpret, blocks)
  rule = Lion(b1, b2, weight_decay)
  out = apply_rule(rule, param, grad, (mu,), 0, lr=lr, master=master, options=options)
  return LionUpdate(out.param, *out.slots, out.master)


def sgd_update(
  param,  # [...] bf16 / f32
  grad,  # [...] float
  trace,  # [...] f32 momentum buffer
  *,
  lr,
  momentum: float = 0.9,
  nesterov: bool = False,
  master=None,  # [...] f32
  impl: str = "auto",
  platform=None,
  interpret=None,
  blocks: ElementwiseBlocks | MultiTensorBlocks | None = None,
) -> SGDUpdate:
  """One step of ``optax.sgd(lr, momentum, nesterov)`` then ``optax.apply_updates``."""
  options = KernelOptions(impl, platform, interpret, blocks)
  rule = SGD(momentum, nesterov)
  out = apply_rule(rule, param, grad, (trace,), 0, lr=lr, master=master, options=options)
  return SGDUpdate(out.param, *out.slots, out.master)
