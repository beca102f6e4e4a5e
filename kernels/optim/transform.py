"""A rule over a parameter tree: an ``optax.GradientTransformation`` (init / update, composable with
``optax.chain``, clipping and weight-decay masks) and the in-place step, both one call per leaf of
:func:`kernels.optim.leaf.update_leaf`. With ``mesh`` and ``partition_specs`` each leaf's update runs
on the local shard under ``shard_map``: no gather of full parameters, no communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kernels.optim.leaf import KernelOptions, Write, update_leaf
from kernels.optim.rules import NON_NEGATIVE, Rule, check_range


class FusedState(NamedTuple):
  count: jax.Array  # int32 [], steps taken
  slots: dict[str, Any]  # slot name (rule.slots) -> f32 tree shaped like the params


@dataclasses.dataclass(frozen=True, eq=False)
class FusedOptimizer:
  """``rule`` over a tree. learning_rate: float or optax schedule (evaluated at the pre-increment
  count, as optax does); mask: pytree of bools or callable(params) choosing which leaves get weight
  decay; mesh + partition_specs: shard-local updates; options: kernel choice and tiles."""

  rule: Rule
  learning_rate: Any
  mask: Any = None
  mesh: Any = None
  partition_specs: Any = None
  options: KernelOptions = dataclasses.field(default_factory=KernelOptions)

  def __post_init__(self):
    if not callable(self.learning_rate):
      check_range("learning_rate", self.learning_rate, NON_NEGATIVE)
    if (self.mesh is None) != (self.partition_specs is None):
      raise ValueError("pass both mesh and partition_specs, or neither")
    if self.mask is not None and not hasattr(self.rule, "weight_decay"):
      raise ValueError(f"mask chooses weight-decayed leaves; {type(self.rule).__name__} has none")

  def init(self, params) -> FusedState:
    slots = {k: jax.tree.map(_zeros_f32, params) for k in self.rule.slots}
    return FusedState(jnp.zeros([], jnp.int32), slots)

  def update(self, updates, state: FusedState, params=None):
    """optax's update: (deltas for optax.apply_updates, new state)."""
    if params is None:
      if self.rule.decays_weights:
        raise ValueError(
          f"{type(self.rule).__name__}'s update needs params (weight decay reads them)"
        )
      params = updates  # read only by weight decay, which this rule does not apply
    return self._tree(params, updates, state, "delta")

  def step(self, params, grads, state: FusedState):
    """(new params, new state), parameters written in place (donate params and state to jax.jit)."""
    return self._tree(params, grads, state, "param")

  def transformation(self) -> optax.GradientTransformation:
    return optax.GradientTransformation(self.init, self.update)

  def _tree(self, params, grads, state: FusedState, write: Write):
    lr = self.learning_rate
    scalars = self.rule.scalars(lr(state.count) if callable(lr) else lr, state.count)
    leaves, treedef = jax.tree.flatten(params)
    n = len(leaves)
    mask = self.mask(params) if callable(self.mask) else self.mask
    specs = self.partition_specs
    rows = zip(
      leaves,
      _leaves_like(treedef, grads, "updates"),
      [True] * n if mask is None else _leaves_like(treedef, mask, "mask"),
      [None] * n if specs is None else _leaves_like(treedef, specs, "partition_specs"),
      *(_leaves_like(treedef, state.slots[k], k) for k in self.rule.slots),
    )
    outs = [self._leaf(scalars, write, *row) for row in rows]
    columns_out = list(zip(*outs)) or [()] * (1 + len(self.rule.slots))  # () for an empty tree
    new = [treedef.unflatten(list(col)) for col in columns_out]
    return new[0], FusedState(_increment(state.count), dict(zip(self.rule.slots, new[1:])))

  def _leaf(self, scalars, write: Write, p, g, decay, spec, *slots):
    rule = self.rule if decay else self.rule.without_weight_decay()

    def one(p, g, *slots):
      out = update_leaf(rule, p, g, slots, scalars, write=write, options=self.options)
      return (out.param, *out.slots)

    if spec is not None:
      n = len(slots)
      one = jax.shard_map(
        one,
        mesh=self.mesh,
        in_specs=(spec,) * (2 + n),
        out_specs=(spec,) * (1 + n),
        check_vma=False,
      )
    return one(p, g, *slots)


def _zeros_f32(p):
  return jnp.zeros_like(p, dtype=jnp.float32)


def _leaves_like(treedef, tree, name: str) -> list:
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{name}: tree structure mismatch with params {treedef}: {e}") from None


def _increment(count):
  inc = getattr(optax, "safe_increment", None) or optax.safe_int32_increment
  return inc(count)


def partition_specs_of(tree):
  """The PartitionSpec of every (concrete, NamedSharding-placed) array in ``tree``."""

  def spec(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
      raise ValueError(
        f"expected arrays placed with a NamedSharding, got {type(sharding).__name__}"
      )
    return sharding.spec

  return jax.tree.map(spec, tree)
