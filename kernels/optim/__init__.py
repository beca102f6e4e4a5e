"""Fused optimizer updates (AdamW, Lion): one Pallas pass per parameter, optax-compatible wrappers.

``adamw_update`` / ``lion_update`` update one array in place (param, grad and state read once, new
param and state written once: 7 x 4 bytes per f32 parameter for AdamW). ``fused_adamw`` /
``fused_lion`` wrap them as ``optax.GradientTransformation`` (composable with e.g.
``optax.clip_by_global_norm``); with ``mesh`` and ``partition_specs`` each device updates its own shard
under ``shard_map`` — no gather of full parameters, no communication.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kernels import backend
from kernels.optim import reference
from kernels.optim.pallas import ElementwiseBlocks, elementwise_call

__all__ = [
  "AdamWUpdate",
  "ElementwiseBlocks",
  "FusedAdamWState",
  "FusedLionState",
  "LionUpdate",
  "adamw_update",
  "fused_adamw",
  "fused_adamw_step",
  "fused_lion",
  "fused_lion_step",
  "lion_update",
  "partition_specs_of",
]


class AdamWUpdate(NamedTuple):
  param: jax.Array  # new parameter (param dtype), or the update delta when called by fused_adamw
  mu: jax.Array  # f32
  nu: jax.Array  # f32
  master: jax.Array | None  # new f32 master copy, when one was given


class LionUpdate(NamedTuple):
  param: jax.Array
  mu: jax.Array
  master: jax.Array | None


def _use_kernel(impl: str, target: backend.Target) -> bool:
  if impl not in ("auto", "pallas", "xla"):
    raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
  return impl == "pallas" or (impl == "auto" and target.platform != "cpu")


def _check_arrays(param, grad, states: dict, master):
  if not jnp.issubdtype(jnp.asarray(param).dtype, jnp.floating):
    raise ValueError(f"param must be floating point, got {jnp.asarray(param).dtype}")
  if not jnp.issubdtype(jnp.asarray(grad).dtype, jnp.floating):
    raise ValueError(f"grad must be floating point, got {jnp.asarray(grad).dtype}")
  shape = jnp.shape(param)
  for name, arr in dict(grad=grad, master=master, **states).items():
    if arr is not None and jnp.shape(arr) != shape:
      raise ValueError(f"{name} shape {jnp.shape(arr)} does not match param shape {shape}")
  for name, arr in dict(master=master, **states).items():
    if arr is not None and jnp.asarray(arr).dtype != jnp.float32:
      raise ValueError(f"{name} must be float32, got {jnp.asarray(arr).dtype}")


def _check_hyper(**hyper):
  for name, value in hyper.items():
    if not isinstance(value, numbers.Real):
      raise ValueError(f"{name} must be a Python number, got {type(value)}")
  for name in ("b1", "b2"):
    if name in hyper and not 0.0 <= hyper[name] < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {hyper[name]}")
  if hyper.get("eps", 0.0) < 0 or hyper.get("weight_decay", 0.0) < 0:
    raise ValueError("eps and weight_decay must be >= 0")


def _apply(
  delta_fn,
  n_state,
  param,
  grad,
  states,
  master,
  scalars,
  *,
  delta_only,
  impl,
  platform,
  interpret,
  blocks,
  name,
):
  """Shared driver: ``delta_fn(p, g, *states, *scalars) -> (delta, *new_states)`` in f32."""
  target = backend.resolve(platform, interpret)
  source = param if master is None else master

  def body(s, p, g, *st):
    delta, *new_states = delta_fn(p, g, *st, *s)
    if delta_only:
      return (delta, *new_states)
    new = p + delta
    return (new, *new_states) + (() if master is None else (new,))

  out_dtypes = (
    [param.dtype]
    + [jnp.float32] * n_state
    + ([] if master is None or delta_only else [jnp.float32])
  )
  if _use_kernel(impl, target):
    aliases = {} if delta_only else {2 + i: 1 + i for i in range(n_state)}
    if not delta_only and master is None:
      aliases[0] = 0
    if not delta_only and master is not None:
      aliases[0] = n_state + 1
    outs = elementwise_call(
      body,
      [source, grad, *states],
      out_dtypes,
      jnp.stack(scalars).astype(jnp.float32),
      target=target,
      blocks=blocks,
      aliases=aliases,
      name=name,
    )
  else:
    outs = body(scalars, *(jnp.asarray(a).astype(jnp.float32) for a in (source, grad, *states)))
    outs = tuple(o.astype(d) for o, d in zip(outs, out_dtypes))
  param_out = outs[
    0
  ]  # the new param in its own dtype (the kernel writes the cast beside the master)
  new_master = None if master is None or delta_only else outs[-1]
  return param_out, outs[1 : 1 + n_state], new_master


def adamw_update(
  param,
  grad,
  mu,
  nu,
  count,
  *,
  lr,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  master=None,
  impl: str = "auto",
  platform=None,
  interpret=None,
  blocks: ElementwiseBlocks | None = None,
  _delta_only: bool = False,
) -> AdamWUpdate:
  """One AdamW step on one array, exactly as ``optax.adamw`` then ``optax.apply_updates``.

  param: [...] bf16/f32; grad: [...] float; mu, nu: [...] f32 moments; count: int scalar, the
  number of steps already taken (optax's ``state.count``); lr: scalar (may be traced). With
  ``master`` ([...] f32) the math runs on the master copy and ``param`` is its cast. Buffers are
  aliased in place: donate them to avoid copies. ``impl``: "pallas" | "xla" | "auto" (kernel on
  TPU / GPU, XLA on CPU).
  """
  _check_arrays(param, grad, dict(mu=mu, nu=nu), master)
  _check_hyper(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  bc1, bc2 = reference.bias_corrections(jnp.asarray(count), b1, b2)
  fn = functools.partial(_adamw_body, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  new, (mu, nu), new_master = _apply(
    fn,
    2,
    param,
    grad,
    (mu, nu),
    master,
    (jnp.asarray(lr, jnp.float32), bc1, bc2),
    delta_only=_delta_only,
    impl=impl,
    platform=platform,
    interpret=interpret,
    blocks=blocks,
    name="adamw_update",
  )
  return AdamWUpdate(new, mu, nu, new_master)


def _adamw_body(p, g, mu, nu, lr, bc1, bc2, **hyper):
  return reference.adamw_delta(p, g, mu, nu, lr, bc1, bc2, **hyper)


def lion_update(
  param,
  grad,
  mu,
  *,
  lr,
  b1: float = 0.9,
  b2: float = 0.99,
  weight_decay: float = 1e-3,
  master=None,
  impl: str = "auto",
  platform=None,
  interpret=None,
  blocks: ElementwiseBlocks | None = None,
  _delta_only: bool = False,
) -> LionUpdate:
  """One Lion step on one array, exactly as ``optax.lion`` then ``optax.apply_updates``.

  param: [...] bf16/f32; grad: [...] float; mu: [...] f32; lr: scalar. See :func:`adamw_update`.
  """
  _check_arrays(param, grad, dict(mu=mu), master)
  _check_hyper(b1=b1, b2=b2, weight_decay=weight_decay)
  fn = functools.partial(_lion_body, b1=b1, b2=b2, weight_decay=weight_decay)
  new, (mu,), new_master = _apply(
    fn,
    1,
    param,
    grad,
    (mu,),
    master,
    (jnp.asarray(lr, jnp.float32),),
    delta_only=_delta_only,
    impl=impl,
    platform=platform,
    interpret=interpret,
    blocks=blocks,
    name="lion_update",
  )
  return LionUpdate(new, mu, new_master)


def _lion_body(p, g, mu, lr, **hyper):
  return reference.lion_delta(p, g, mu, lr, **hyper)


# ------------------------------------------------------------------------------- optax wrappers
class FusedAdamWState(NamedTuple):
  count: jax.Array  # int32 scalar, steps taken
  mu: Any
  nu: Any


class FusedLionState(NamedTuple):
  count: jax.Array
  mu: Any


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


def _increment(count):
  inc = getattr(optax, "safe_increment", None) or optax.safe_int32_increment
  return inc(count)


def _mask_tree(mask, params):
  if mask is None:
    return jax.tree.map(lambda _: True, params)
  return mask(params) if callable(mask) else mask


def _per_leaf(leaf_fn, n_out, mesh, specs, params, *trees):
  """Map ``leaf_fn(scalar_args..., p, g, *states) -> n_out arrays`` over leaves, shard-local."""
  if (mesh is None) != (specs is None):
    raise ValueError("pass both mesh and partition_specs, or neither")
  p_leaves, treedef = jax.tree.flatten(params)
  others = []
  for t in trees:
    leaves, td = jax.tree.flatten(t)
    if td != treedef:
      raise ValueError(f"tree structure mismatch: params {treedef} vs {td}")
    others.append(leaves)
  spec_leaves = [None] * len(p_leaves)
  if specs is not None:
    spec_leaves, td = jax.tree.flatten(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    if len(spec_leaves) != len(p_leaves):
      raise ValueError("partition_specs must have one PartitionSpec per parameter")
  outs = []
  for i, p in enumerate(p_leaves):
    args = [p] + [o[i] for o in others]
    fn = leaf_fn[i]
    if spec_leaves[i] is not None:
      s = spec_leaves[i]
      fn = jax.shard_map(
        fn, mesh=mesh, in_specs=(s,) * len(args), out_specs=(s,) * n_out, check_vma=False
      )
    outs.append(fn(*args))
  return [jax.tree.unflatten(treedef, [o[k] for o in outs]) for k in range(n_out)]


def _adamw_tree(
  learning_rate, hyper, mask, mesh, partition_specs, kw, params, grads, state, delta_only
):
  lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
  wds = [hyper["weight_decay"] if m else 0.0 for m in jax.tree.leaves(_mask_tree(mask, params))]
  leaf_kw = dict(kw, b1=hyper["b1"], b2=hyper["b2"], eps=hyper["eps"], _delta_only=delta_only)
  fns = [functools.partial(_adamw_leaf, state.count, lr, wd, leaf_kw) for wd in wds]
  out, mu, nu = _per_leaf(fns, 3, mesh, partition_specs, params, grads, state.mu, state.nu)
  return out, FusedAdamWState(_increment(state.count), mu, nu)


def _adamw_leaf(count, lr, wd, kw, p, g, mu, nu):
  out = adamw_update(p, g, mu, nu, count, lr=lr, weight_decay=wd, **kw)
  return out.param, out.mu, out.nu


def _lion_tree(
  learning_rate, hyper, mask, mesh, partition_specs, kw, params, grads, state, delta_only
):
  lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
  wds = [hyper["weight_decay"] if m else 0.0 for m in jax.tree.leaves(_mask_tree(mask, params))]
  leaf_kw = dict(kw, b1=hyper["b1"], b2=hyper["b2"], _delta_only=delta_only)
  fns = [functools.partial(_lion_leaf, lr, wd, leaf_kw) for wd in wds]
  out, mu = _per_leaf(fns, 2, mesh, partition_specs, params, grads, state.mu)
  return out, FusedLionState(_increment(state.count), mu)


def _lion_leaf(lr, wd, kw, p, g, mu):
  out = lion_update(p, g, mu, lr=lr, weight_decay=wd, **kw)
  return out.param, out.mu


def _zeros_f32(params):
  return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params)


def _make(tree_fn, init, learning_rate, hyper, mask, mesh, partition_specs, kw):
  """(GradientTransformation, in-place step) sharing one tree function."""
  _check_hyper(**hyper)
  run = functools.partial(tree_fn, learning_rate, hyper, mask, mesh, partition_specs, kw)

  def update(grads, state, params=None):
    if params is None:
      raise ValueError(
        "the fused optimizers' update needs params (weight decay and the fused update read them)"
      )
    return run(params, grads, state, True)

  def step(params, grads, state):
    return run(params, grads, state, False)

  return optax.GradientTransformation(init, update), step


def _adamw_init(params):
  return FusedAdamWState(jnp.zeros([], jnp.int32), _zeros_f32(params), _zeros_f32(params))


def _lion_init(params):
  return FusedLionState(jnp.zeros([], jnp.int32), _zeros_f32(params))


_DOC_COMMON = """
  learning_rate: float or optax schedule (evaluated at the pre-increment count, as optax does);
  mask: pytree of bools or callable(params) choosing which leaves get weight decay; mesh and
  partition_specs: run each leaf's update on its local shard under shard_map; impl / platform /
  interpret: as :func:`adamw_update`.
"""


def fused_adamw(
  learning_rate,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  *,
  mask=None,
  mesh=None,
  partition_specs=None,
  impl: str = "auto",
  platform=None,
  interpret=None,
) -> optax.GradientTransformation:
  return fused_adamw_step(
    learning_rate,
    b1,
    b2,
    eps,
    weight_decay,
    mask=mask,
    mesh=mesh,
    partition_specs=partition_specs,
    impl=impl,
    platform=platform,
    interpret=interpret,
  )[0]


def fused_adamw_step(
  learning_rate,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  *,
  mask=None,
  mesh=None,
  partition_specs=None,
  impl: str = "auto",
  platform=None,
  interpret=None,
):
  return _make(
    _adamw_tree,
    _adamw_init,
    learning_rate,
    dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
    mask,
    mesh,
    partition_specs,
    dict(impl=impl, platform=platform, interpret=interpret),
  )


def fused_lion(
  learning_rate,
  b1: float = 0.9,
  b2: float = 0.99,
  weight_decay: float = 1e-3,
  *,
  mask=None,
  mesh=None,
  partition_specs=None,
  impl: str = "auto",
  platform=None,
  interpret=None,
) -> optax.GradientTransformation:
  return fused_lion_step(
    learning_rate,
    b1,
    b2,
    weight_decay,
    mask=mask,
    mesh=mesh,
    partition_specs=partition_specs,
    impl=impl,
    platform=platform,
    interpret=interpret,
  )[0]


def fused_lion_step(
  learning_rate,
  b1: float = 0.9,
  b2: float = 0.99,
  weight_decay: float = 1e-3,
  *,
  mask=None,
  mesh=None,
  partition_specs=None,
  impl: str = "auto",
  platform=None,
  interpret=None,
):
  return _make(
    _lion_tree,
    _lion_init,
    learning_rate,
    dict(b1=b1, b2=b2, weight_decay=weight_decay),
    mask,
    mesh,
    partition_specs,
    dict(impl=impl, platform=platform, interpret=interpret),
  )


fused_adamw.__doc__ = (
  """``optax.adamw`` as one fused kernel per parameter; ``update`` needs ``params``.

  Through the optax API the kernel returns the update delta, which ``optax.apply_updates`` adds:
  10 x 4 bytes per f32 parameter. :func:`fused_adamw_step` writes the parameters in place instead
  (7 x 4 bytes, the minimum).
"""
  + _DOC_COMMON
)
fused_adamw_step.__doc__ = (
  """``(tx, step)``: the optax transformation of :func:`fused_adamw` and an in-place
  ``step(params, grads, state) -> (new_params, new_state)`` that writes parameters directly (donate
  params and state to ``jax.jit`` so the aliased buffers are reused).
"""
  + _DOC_COMMON
)
fused_lion.__doc__ = (
  """``optax.lion`` as one fused kernel per parameter; see :func:`fused_adamw`.""" + _DOC_COMMON
)
fused_lion_step.__doc__ = """``(tx, step)`` for Lion; see :func:`fused_adamw_step`.""" + _DOC_COMMON
