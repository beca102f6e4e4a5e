"""Optimizer bench cases: fused AdamW / Lion / SGD vs optax on a decoder-shaped f32 parameter tree.

Two kernel variants per optimizer: ``inplace`` (fused_*_step, writes params: the 7 x 4 bytes/param
minimum for AdamW) and ``optax-api`` (the GradientTransformation returning a delta, then
``optax.apply_updates``). The reference is ``optax.adamw`` / ``optax.lion`` / ``optax.sgd`` +
``apply_updates`` under one jit, which XLA fuses per leaf.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from bench.cases import Case, Check
from bench.shapes import decoder_param_shapes
from kernels import optim

SHAPES_BY_SIZE = {
  "tiny": ("tiny",),
  "small": ("cpu-small",),
  "large": ("qwen2.5-0.5b", "qwen2.5-1.5b"),
}
# bytes per f32 parameter: AdamW reads p, g, mu, nu and writes p, mu, nu; Lion reads p, g, mu, writes
# p, mu; SGD with momentum reads p, g, trace, writes p, trace
BYTES_PER_PARAM = {"adamw": 7 * 4, "lion": 5 * 4, "sgd": 5 * 4}
HYPER = {
  "adamw": dict(learning_rate=1e-3, weight_decay=0.1),
  "lion": dict(learning_rate=1e-4, weight_decay=0.1),
  "sgd": dict(learning_rate=1e-2, momentum=0.9, nesterov=True),
}
SLOTS = {"adamw": optim.AdamW.slots, "lion": optim.Lion.slots, "sgd": optim.SGD.slots}
OPTAX = {"adamw": optax.adamw, "lion": optax.lion, "sgd": optax.sgd}
FUSED_STEP = {
  "adamw": optim.fused_adamw_step,
  "lion": optim.fused_lion_step,
  "sgd": optim.fused_sgd_step,
}


def make_inputs(shapes: dict[str, tuple[int, ...]], which: str, seed: int):
  keys = iter(jax.random.split(jax.random.key(seed), 2 * len(shapes)))
  params = {k: jax.random.normal(next(keys), s, jnp.float32) * 0.02 for k, s in shapes.items()}
  grads = {k: jax.random.normal(next(keys), s, jnp.float32) * 1e-3 for k, s in shapes.items()}
  # start from a non-trivial state: one optax step
  tx = _optax(which)
  state = tx.init(params)
  _, state = tx.update(grads, state, params)
  return params, grads, state


def _optax(which):
  return OPTAX[which](**HYPER[which])


def _reference(which, params, grads, state):
  updates, state = _optax(which).update(grads, state, params)
  return optax.apply_updates(params, updates), state


def _fused_pair(which, platform):
  return FUSED_STEP[which](**HYPER[which], impl="pallas", platform=platform)


def _convert_state(which, state):
  """optax state -> the fused state (the same moment arrays; optax.sgd keeps no count)."""
  inner = state[0]
  count = inner.count if "count" in inner._fields else jnp.zeros([], jnp.int32)
  return optim.FusedState(count, {k: getattr(inner, k) for k in SLOTS[which]})


def _inplace(which, platform, params, grads, state):
  _, step = _fused_pair(which, platform)
  return step(params, grads, _convert_state(which, state))


def _optax_api(which, platform, params, grads, state):
  tx, _ = _fused_pair(which, platform)
  updates, new_state = tx.update(grads, _convert_state(which, state), params)
  return optax.apply_updates(params, updates), new_state


def cases(size: str, platform: str) -> list[Case]:
  out = []
  for name in SHAPES_BY_SIZE[size]:
    shapes = decoder_param_shapes(name)
    n_leaves, n_params = len(shapes), sum(math.prod(s) for s in shapes.values())
    params_check = Check(tuple(range(n_leaves)), "optimizer", "float32", 1, "params")
    for which in HYPER:
      inputs = functools.partial(make_inputs, shapes, which)
      ref = functools.partial(_reference, which)
      info = dict(model=name, params=n_params, leaves=n_leaves, dtype="float32")
      for variant, fn in (("inplace", _inplace), ("optax-api", _optax_api)):
        out.append(
          Case(
            f"optim/{which}-{variant}",
            name,
            "step",
            inputs,
            functools.partial(fn, which, platform),
            ref,
            BYTES_PER_PARAM[which] * n_params,
            None,
            (params_check,),
            info,
          )
        )
  return out
