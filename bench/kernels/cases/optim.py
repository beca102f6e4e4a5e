"""Optimizer bench cases: fused AdamW / Lion / SGD vs optax on a decoder-shaped f32 parameter tree.

Two kernel variants per optimizer, both the multi-tensor step (one launch for the whole tree: Triton,
kernels/optim/pallas_triton.py, on GPU; Mosaic, kernels/optim/pallas_tpu.py, on TPU): ``inplace`` (fused_*_step, writes params: the 7 x 4 bytes/param minimum for
AdamW) and ``optax-api`` (the GradientTransformation returning a delta, then
``optax.apply_updates``: 10 words). The reference is ``optax.adamw`` / ``optax.lion`` / ``optax.sgd`` +
``apply_updates`` under one jit.

Memory (:func:`memory_need`: XLA's memory analysis of the case's own functions compiled for the host
from abstract inputs; the tree is 5.75 GiB at qwen2.5-1.5b). AdamW at 1.5B, not donated: kernel and
reference peak 40.26 GiB each (4 input trees + 3 output trees); the harness keeps the kernel's outputs
(17.25 GiB) while the reference runs, so the case needs 57.51 GiB — under the 59.7 GiB jax
preallocates on an 80 GB H100 (75 %) only while the GPU's fusions need < 2.2 GiB of temporaries
(the 2026-11-24 run ran out of memory there). Donated (``DONATE_ARGNUMS``: params and state), each
peak is 23.00 GiB (outputs alias the inputs) and the case needs 40.26 GiB (kernel outputs + the
reference's fresh inputs). Lion at 1.5B: peaks 28.75 GiB, need 40.26 GiB not donated; peaks 23.00,
need 34.50 donated. SGD: 28.75 / 40.26 not donated, 17.25 / 28.75 donated.
Without donation the in-place kernel also pays XLA's copies of param, mu and nu before the aliased
launch (13 words, not 7), so every optim case sets ``Case.donate_argnums``: the harness compiles both
sides with params and state donated, gives each timed call fresh inputs (made outside the timer) and
checks parity on two fresh copies of the seed's inputs (``bench.kernels.run``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from bench.kernels.cases import Case, Check
from bench.shapes import decoder_param_shapes
from kernels import optim
from kernels.optim.pallas_triton_evidence import launch_evidence

SHAPES_BY_SIZE = {
  "tiny": ("tiny",),
  "small": ("cpu-small",),
  "large": ("qwen2.5-0.5b", "qwen2.5-1.5b"),
}
# bytes per f32 parameter: AdamW reads p, g, mu, nu and writes p, mu, nu; Lion reads p, g, mu, writes
# p, mu; SGD with momentum reads p, g, trace, writes p, trace
BYTES_PER_PARAM = {"adamw": 7 * 4, "lion": 5 * 4, "sgd": 5 * 4}
ARRAYS = {"adamw": (4, 3), "lion": (3, 2), "sgd": (3, 2)}  # (read, written) per parameter
HYPER = {
  "adamw": dict(learning_rate=1e-3, weight_decay=0.1),
  "lion": dict(learning_rate=1e-4, weight_decay=0.1),
  "sgd": dict(learning_rate=1e-2, momentum=0.9, nesterov=True),
}
# params (arg 0) and the optimizer state (arg 2) are updated in place; grads (arg 1) are only read
DONATE_ARGNUMS = (0, 2)
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
  # start from a non-trivial state: one optax step, jitted with the zero state donated, so making the
  # inputs never holds more than the case's own trees plus the step's outputs
  tx = _optax(which)
  first = jax.jit(lambda g, s, p: tx.update(g, s, p)[1], donate_argnums=(1,))
  state = first(grads, tx.init(params), params)
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
      plan = launch_evidence([math.prod(s) for s in shapes.values()], *ARRAYS[which])
      info = dict(model=name, params=n_params, leaves=n_leaves, dtype="float32")
      info.update(programs=plan.programs, waves_h100=round(plan.waves, 1))
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
            donate_argnums=DONATE_ARGNUMS,
          )
        )
  return out


def memory_need(shape_name: str, which: str, donate: bool) -> dict[str, float]:
  """GiB by XLA's memory analysis on the host backend (abstract inputs, nothing allocated): the
  in-place step's and the reference's peaks (arguments + outputs - aliased + temporaries) and what
  the case needs while the kernel's outputs stay live for parity. The kernel is its XLA twin
  (``impl="xla"``: the same operands and outputs; the Triton launch adds no buffer)."""
  shapes = decoder_param_shapes(shape_name)
  tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  args = (tree, tree, jax.eval_shape(_optax(which).init, tree))
  step = FUSED_STEP[which](**HYPER[which], impl="xla")[1]
  fns = {
    "kernel": lambda p, g, s: step(p, g, _convert_state(which, s)),
    "reference": functools.partial(_reference, which),
  }
  out = {}
  for side, fn in fns.items():
    compiled = jax.jit(fn, donate_argnums=DONATE_ARGNUMS if donate else ()).lower(*args).compile()
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    out[f"{side}_peak"] = (peak + m.temp_size_in_bytes) / 2**30
    out[f"{side}_outputs"] = m.output_size_in_bytes / 2**30
  # donated: the kernel consumed its inputs, the reference runs on fresh ones beside the kernel's
  # outputs; not donated: the reference runs beside the inputs and the kernel's outputs
  out["case_need"] = max(out["kernel_peak"], out["reference_peak"] + out["kernel_outputs"])
  return out
