"""One rule applied to one array: the Pallas kernel or its pure-JAX reference, same body."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from kernels import autotune, backend
from kernels.optim.impls import OP
from kernels.optim.pallas_blocks import ElementwiseBlocks, MultiTensorBlocks
from kernels.optim.rules import NON_NEGATIVE, Rule, check_range
from kernels.optim.work import LeafWork

# "param": write the new parameter (and master, state) in place; "delta": return the update that
# optax.apply_updates adds (the GradientTransformation path), nothing aliased.
Write = Literal["param", "delta"]


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """impl: "pallas" | "xla" | "auto" (kernel on TPU / GPU, XLA on CPU); platform / interpret: the
  target (see kernels.backend); blocks: ``MultiTensorBlocks`` for the GPU (rowloop) family,
  ``ElementwiseBlocks`` for the tiled family (TPU, CPU interpreter); None: the heuristic."""

  impl: str = "auto"
  platform: str | None = None
  interpret: bool | None = None
  blocks: ElementwiseBlocks | MultiTensorBlocks | None = None

  def __post_init__(self):
    OP.check(self.impl)


class RuleUpdate(NamedTuple):
  param: jax.Array  # [...] new parameter (param dtype), or the update delta for write="delta"
  slots: tuple[jax.Array, ...]  # [...] f32 each, the rule's new state in ``rule.slots`` order
  master: jax.Array | None  # [...] f32 new master copy, when one was given


def apply_rule(
  rule: Rule,
  param,  # [...] bf16 / f32
  grad,  # [...] float
  slots: Sequence,  # [...] f32 each, in rule.slots order
  count,  # int [], steps already taken (optax's state.count)
  *,
  lr,  # [] learning rate, may be traced
  master=None,  # [...] f32 master copy of a low-precision param
  options: KernelOptions = KernelOptions(),
) -> RuleUpdate:
  """One step of ``rule`` on one array, writing the new parameter (as optax's update then
  ``apply_updates``). With ``master`` the math runs on it and ``param`` is its cast. Buffers are
  aliased in place: donate them to avoid copies. Concrete ``lr`` / ``count`` are range-checked."""
  check_range("lr", lr, NON_NEGATIVE)
  check_range("count", count, NON_NEGATIVE)
  scalars = rule.scalars(lr, count)
  return update_leaf(rule, param, grad, tuple(slots), scalars, master=master, options=options)


def update_leaf(
  rule: Rule,
  param,  # [...] bf16 / f32
  grad,  # [...] float
  slots: tuple,  # [...] f32 each
  scalars: tuple,  # f32 [] each, from rule.scalars
  *,
  master=None,  # [...] f32
  write: Write = "param",
  options: KernelOptions,
) -> RuleUpdate:
  """The driver under :func:`apply_rule`: one leaf; nothing range-checked."""
  (out,) = update_leaves(
    [rule], [param], [grad], [slots], scalars, masters=[master], write=write, options=options
  )
  return out


def update_leaves(
  rules: Sequence[Rule],  # one per leaf (the weight-decay mask picks each leaf's rule)
  params: Sequence,  # [...] bf16 / f32 each
  grads: Sequence,  # [...] float each, shaped like its param
  slots: Sequence[tuple],  # per leaf: [...] f32 each, in rule.slots order
  scalars: tuple,  # f32 [] each, from rule.scalars
  *,
  masters: Sequence | None = None,  # per leaf: [...] f32 or None
  write: Write = "param",
  options: KernelOptions,
) -> list[RuleUpdate]:
  """Every leaf's step: one multi-tensor launch for all of them (the Triton walk of
  :mod:`kernels.optim.pallas_triton` on GPU, the Mosaic one of :mod:`kernels.optim.pallas_tpu` on
  TPU and its interpreter), else the XLA reference: the impl of ``options`` in the op's table
  (:mod:`kernels.optim.impls`)."""
  masters = [None] * len(params) if masters is None else list(masters)
  works, leads = [], []
  for rule, p, g, s, m in zip(rules, params, grads, slots, masters, strict=True):
    work, lead = _leaf_work(rule, jnp.asarray(p), jnp.asarray(g), tuple(s), m, write)
    works.append(work)
    leads.append(lead)
  target = backend.resolve(options.platform, options.interpret)
  options = tuned_options(options, target, rules, params)
  name = f"{type(rules[0]).__name__.lower()}_update" if rules else "update"
  impl = OP.default(options.impl, target)
  outs = OP[impl].run(works, scalars, target, options.blocks, write, name)
  return [
    RuleUpdate(o[lead], tuple(o[k] for k in rule.slots), o.get("master"))
    for o, lead, rule in zip(outs, leads, rules)
  ]


def tuned_options(options: KernelOptions, target, rules: Sequence[Rule], params) -> KernelOptions:
  """``options`` with ``impl="auto"`` / ``blocks=None`` filled from the autotuner's cache (op
  "optim", bucket: rule, param dtype, total parameters; bench.tune writes it) on the target's device
  kind; tiles of the other kernel family, a malformed entry or an unreadable cache leave the
  heuristics, with a warning (:func:`kernels.autotune.resolve`)."""
  if not rules:
    return options
  shape = dict(
    rule=type(rules[0]).__name__.lower(),
    dtype=jnp.result_type(params[0]).name,
    params=sum(math.prod(jnp.shape(p)) for p in params),
  )
  impl, blocks = autotune.resolve(OP, options.impl, options.blocks, target, shape)
  return dataclasses.replace(options, impl=impl, blocks=blocks)


def _leaf_work(rule: Rule, param, grad, slots: tuple, master, write: Write):
  """The leaf's kernel body, named inputs and outputs, and the name of its lead output."""
  _check_arrays(rule, param, grad, slots, master)
  src = "param" if master is None else "master"
  inputs = {src: param if master is None else master, "grad": grad, **dict(zip(rule.slots, slots))}
  lead = "param" if write == "param" else "delta"
  outputs = {lead: param.dtype, **dict.fromkeys(rule.slots, jnp.float32)}
  with_master = master is not None and write == "param"
  if with_master:
    outputs["master"] = jnp.float32

  def body(scalars, p, g, *state):
    delta, new_state = rule.delta(p, g, scalars, *state)
    if write == "delta":
      return (delta, *new_state)
    p = p + delta  # the kernel writes its cast to the param dtype beside the f32 master
    return (p, *new_state, p) if with_master else (p, *new_state)

  key = (rule, src, write, with_master)  # what the body depends on, besides its arrays
  return LeafWork(body, inputs, outputs, key), lead


def _check_arrays(rule: Rule, param, grad, slots: tuple, master):
  for name, arr in (("param", param), ("grad", grad)):
    if not jnp.issubdtype(jnp.result_type(arr), jnp.floating):
      raise ValueError(f"{name} must be floating point, got {jnp.result_type(arr)}")
  if len(slots) != len(rule.slots):
    raise ValueError(f"{type(rule).__name__} takes state {rule.slots}, got {len(slots)} arrays")
  shape = jnp.shape(param)
  named = dict(zip(rule.slots, slots), master=master)
  for name, arr in dict(grad=grad, **named).items():
    if arr is not None and jnp.shape(arr) != shape:
      raise ValueError(f"{name} shape {jnp.shape(arr)} does not match param shape {shape}")
  for name, arr in named.items():
    if arr is not None and jnp.result_type(arr) != jnp.float32:
      raise ValueError(f"{name} must be float32, got {jnp.result_type(arr)}")
