"""The training path of the GRPO loss (a forward that also writes dlogits: two passes): its config and
the in-kernel coefficient.

When gradients come only from the loss (the training step), a token's loss weight is a function of
its own log p (token-level specs), so the forward can finish the job per row: statistics over the
row, then log p, then the coefficient ``g = d loss / d logp / T`` in-kernel
(:func:`kernels.objective.token_coefficient`, autodiff of the shared objective), then
``dlogits = g * (onehot(id) - softmax(z))`` written in the logits' dtype. Forward + backward move
one read of the logits and one write of dlogits; the backward only applies the loss's cotangent
(:mod:`kernels.grpo_loss.vjp`).

Here: the training path's static config and the in-kernel coefficient, which every kernel family
evaluates (the training kernels: ``train_fwd`` of :mod:`kernels.grpo_loss.pallas_tpu`,
:mod:`kernels.grpo_loss.pallas_triton`, :mod:`kernels.grpo_loss.mosaic_gpu_train` and
:mod:`kernels.grpo_loss.mosaic_gpu_cluster`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.loss_spec import LossSpec
from kernels.objective import token_coefficient

# Per-token inputs of the in-kernel coefficient, in this order; old / ref / sampler only when given.
TOKEN_FIELDS = ("mask", "advantages", "weight", "old_logps", "ref_logps", "sampler_logps")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Static settings of one training-path call: the kernel's and the loss's."""

  loss: LossConfig  # or a mosaic_gpu.MosaicLossConfig (kernels.grpo_loss.mosaic_gpu_train)
  spec: LossSpec  # token-level
  fields: tuple[str, ...]  # the TOKEN_FIELDS present, in order


def coefficient(cfg: TrainConfig, logp, tok: dict):
  """g = d loss / d z_chosen for rows whose log p is ``logp``; tok maps each field to the same shape.

  Traced once into a jaxpr and replayed primitive by primitive, with ``stop_gradient`` as the identity
  (nothing differentiates the kernel body; Mosaic GPU has no lowering rule for it) and nested
  ``jit`` / ``custom_jvp_call`` inlined.
  """
  names = ("logp",) + cfg.fields

  def g(*values):
    v = dict(zip(names, values))
    logps = {k: v[k] for k in cfg.fields[3:]}
    return token_coefficient(
      v["logp"], v["mask"] != 0, v["advantages"], v["weight"], cfg.spec, **logps
    )

  args = (logp,) + tuple(tok[k] for k in cfg.fields)
  shapes = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.float32) for a in args]
  closed = jax.make_jaxpr(g)(*shapes)
  (out,) = _replay(closed.jaxpr, closed.consts, args)
  return out * (1.0 / cfg.loss.temperature)


_INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr"}
_FOLD = {  # scalar arithmetic on constants, computed here (numpy)
  "neg": np.negative,
  "convert_element_type": lambda x: x,
  "add": np.add,
  "sub": np.subtract,
  "mul": np.multiply,
  "div": np.divide,
  "max": np.maximum,
  "min": np.minimum,
}


def _replay(jaxpr, consts, args):
  """Evaluate ``jaxpr`` on ``args`` binding each primitive: stop_gradient dropped, nested calls
  inlined, reshapes without the mesh sharding that tracing under ``use_target`` attaches."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda var: var.val if isinstance(var, jax_core.Literal) else env[var]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in ("stop_gradient", "reshard"):  # no autodiff and no sharding inside a kernel
      outs = ins
    elif name.startswith("reduce_") and eqn.params.get("axes") == ():
      # a sum over no axes (the objective traced on one row's scalars, the cluster kernel): the
      # identity, which Mosaic GPU has no rule for on a scalar
      outs = ins
    elif name == "add_any":  # autodiff's cotangent sum: a plain add (Mosaic GPU lowers only that)
      outs = [jax.lax.add(*ins)]
    elif name in _INLINED:
      inner = eqn.params[_INLINED[name]]
      outs = _replay(inner.jaxpr, inner.consts, ins[len(ins) - len(inner.jaxpr.invars) :])
    else:
      params = dict(eqn.params)
      if name == "reshape":  # traced under an (abstract) mesh: kernel values carry no sharding
        params["sharding"] = None
      # Scalar math on constants (-clip bounds, literal casts) is folded here, never left to a
      # kernel lowering (jax 0.11's Mosaic GPU returns a Python float for neg of a literal).
      if name in _FOLD and not any(isinstance(x, jax.core.Tracer) for x in ins):
        dtype = eqn.outvars[0].aval.dtype
        outs = [np.asarray(_FOLD[name](*(np.asarray(x) for x in ins)), dtype)]
      else:
        outs = eqn.primitive.bind(*ins, **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]
