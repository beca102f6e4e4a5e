"""The optimizer of the update: AdamW or Lion after global-norm clipping (kernels.optim's one-pass
kernels, each device updating its own shard, or optax), the learning-rate schedule, and the optimizer
state laid out like the parameters it tracks."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import kernels
from rl.model.partition import path_name


def _global_norm(tree):
  tree_ns = getattr(optax, "tree", None)  # optax >= 0.2.5 moved it; global_norm warns since
  return (
    tree_ns.norm(tree)
    if tree_ns is not None and hasattr(tree_ns, "norm")
    else optax.global_norm(tree)
  )


class Optimizer(NamedTuple):
  """`step(params, grads, state) -> (params, state)` and `init(params) -> state`; `finite_after(params,
  grads, state) -> bool[]`: whether step's new params would all be finite, computed without keeping
  them (the fused path: see guarded_step), or None."""

  init: Any
  step: Any
  finite_after: Any = None


def _all_finite(tree) -> jax.Array:  # -> [] bool (True for a tree without leaves)
  leaves = jax.tree.leaves(tree)
  return (
    jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)
  )


def guarded_step(optimizer: Optimizer, params, grads, state, inputs_ok):
  """(params, state, finite): the step when `inputs_ok` (a finite loss and gradient norm) and its new
  params are all finite, else params and state as they came.

  optax: the step, then a select between the new and the old trees. The fused kernels write params
  and state in place, so a select after them keeps a copy of the whole old trainer state alive
  beside the new one (compiled for a v4 chip, Qwen3-4B: 9.3 GiB more, and the train step no longer
  fit); instead the new params' finiteness is found first by the rule's XLA twin reduced on the fly
  (`finite_after`: one more read of params, grads and state, nothing stored), and the kernels run
  under a lax.cond, in place."""
  if optimizer.finite_after is None:
    new_params, new_state = optimizer.step(params, grads, state)
    finite = inputs_ok & _all_finite(new_params)
    keep = lambda new, old: jnp.where(finite, new, old)
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, state), finite
  finite = inputs_ok & optimizer.finite_after(params, grads, state)
  new_params, new_state = jax.lax.cond(
    finite, optimizer.step, lambda p, g, s: (p, s), params, grads, state
  )
  return new_params, new_state, finite


def warmup_schedule(learning_rate: float, warmup_steps: int, decay_steps: int = 0):
  """`learning_rate`, reached linearly over the first `warmup_steps` updates (step k uses
  lr * (k + 1) / warmup_steps), then, when `decay_steps` > 0, a cosine decay to a tenth of it at
  update `decay_steps` (held there after); constant otherwise. A fresh Adam state's first updates
  move every weight by about lr whatever the gradient's size, which is what knocks a warmed-up policy
  off its supervised solution when RL starts at full rate; the decay keeps a policy that has learned
  from being shaken out of it by the late updates' noise."""
  if warmup_steps < 0 or decay_steps < 0:
    raise ValueError(
      f"warmup_steps and decay_steps must be >= 0, got {warmup_steps}, {decay_steps}"
    )
  if warmup_steps == 0 and decay_steps == 0:
    return learning_rate

  def rate(count):
    warm = jnp.minimum(1.0, (count + 1) / max(warmup_steps, 1))
    if decay_steps <= warmup_steps:
      return learning_rate * warm
    done = jnp.clip((count - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
    return learning_rate * warm * (0.1 + 0.45 * (1.0 + jnp.cos(jnp.pi * done)))

  return rate


def make_optimizer(
  name: str,
  learning_rate,  # float or optax schedule (count -> rate)
  weight_decay: float,
  max_grad_norm: float,
  fused: bool,
  mesh=None,
  partition_specs=None,
) -> Optimizer:
  """AdamW or Lion after global-norm clipping; `fused` uses kernels.optim's one-pass kernels (each
  device updating its own shard when `mesh` and `partition_specs` are given), else optax."""
  if name not in ("adamw", "lion"):
    raise ValueError(f"optimizer must be 'adamw' or 'lion', got {name!r}")
  clip = optax.clip_by_global_norm(max_grad_norm) if max_grad_norm > 0 else optax.identity()
  if fused:
    make = kernels.optim.fused_adamw_step if name == "adamw" else kernels.optim.fused_lion_step
    tx, fused_step = make(
      learning_rate, weight_decay=weight_decay, mesh=mesh, partition_specs=partition_specs
    )

    def init(params):
      return clip.init(params), tx.init(params)

    def step(params, grads, state):
      grads, clip_state = clip.update(grads, state[0])
      params, opt_state = fused_step(params, grads, state[1])
      return params, (clip_state, opt_state)

    # the same rule in XLA (no mesh: the partitioner keeps it shard-local), only reduced
    _, xla_step = make(learning_rate, weight_decay=weight_decay, impl="xla")

    def finite_after(params, grads, state):
      grads, _ = clip.update(grads, state[0])
      return _all_finite(xla_step(params, grads, state[1])[0])

    return Optimizer(init, step, finite_after)
  base = (
    optax.adamw(learning_rate, weight_decay=weight_decay)
    if name == "adamw"
    else optax.lion(learning_rate, weight_decay=weight_decay)
  )
  tx = optax.chain(clip, base)

  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Optimizer(tx.init, step)


def shardings_of(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def opt_state_shardings(shapes, params, mesh):
  """Shardings of an optimizer state `shapes` (its tree, abstract or not) laid out like the parameters
  it tracks: mu / nu of a weight share the weight's sharding (matched by name), anything else
  (counters) is replicated."""
  by_name = {path_name(k): x.sharding for k, x in jax.tree_util.tree_leaves_with_path(params)}

  def place(path, leaf):
    name = path_name(path)
    for pname, sharding in by_name.items():
      if name == pname or name.endswith("." + pname):
        return sharding
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree_util.tree_map_with_path(place, shapes)


def init_optimizer_state(optimizer: Optimizer, params, mesh):
  """The optimizer state laid out like the parameters it tracks (opt_state_shardings), so every
  step's input and output layouts agree."""
  shapes = jax.eval_shape(optimizer.init, params)
  out = opt_state_shardings(shapes, params, mesh)
  return jax.jit(optimizer.init, out_shardings=out)(params)
