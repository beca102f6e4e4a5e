"""A rule over a parameter tree: an ``optax.GradientTransformation`` (init / update, composable with
``optax.chain``, clipping and weight-decay masks) and the in-place step, both one call of
:func:`kernels.optim.leaf.update_leaves` for the whole tree (on GPU: one multi-tensor launch). With
``mesh`` and ``partition_specs`` the whole tree's update runs under one ``shard_map`` whose in / out
specs are each leaf's own: every device updates its local shards in one launch, no gather of full
parameters, no communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kernels.optim.leaf import KernelOptions, Write, update_leaves
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
    decay = [True] * n if mask is None else _leaves_like(treedef, mask, "mask")
    rules = [self.rule if d else self.rule.without_weight_decay() for d in decay]
    g = _leaves_like(treedef, grads, "updates")
    slots = [_leaves_like(treedef, state.slots[k], k) for k in self.rule.slots]

    def run(ps, gs, *slot_columns):  # lists of leaves (local shards under shard_map)
      outs = update_leaves(
        rules,
        ps,
        gs,
        list(zip(*slot_columns)) or [()] * len(ps),
        scalars,
        write=write,
        options=self.options,
      )
      return [o.param for o in outs], tuple([o.slots[k] for o in outs] for k in range(len(slots)))

    if self.partition_specs is not None and n:
      # one shard_map over the whole tree, each leaf with its own spec: every device walks its own
      # shards in one launch; no gather, no communication
      specs = _leaves_like(treedef, self.partition_specs, "partition_specs")
      run = jax.shard_map(
        run,
        mesh=self.mesh,
        in_specs=(specs, specs, *([specs] * len(slots))),
        out_specs=(specs, tuple([specs] * len(slots))),
        check_vma=False,
      )
    new_params, new_slots = run(leaves, g, *slots) if n else ([], tuple([] for _ in slots))
    new_state = {k: treedef.unflatten(list(col)) for k, col in zip(self.rule.slots, new_slots)}
    return treedef.unflatten(list(new_params)), FusedState(_increment(state.count), new_state)


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
