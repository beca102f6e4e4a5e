"""The training-path kernels of the GRPO loss: a forward that also writes dlogits (two passes).

When gradients come only from the loss (the training step), a token's loss weight is a function of
its own log p (token-level specs), so the forward can finish the job per row: statistics over the
row, then log p, then the coefficient ``g = d loss / d logp / T`` in-kernel
(:func:`kernels.objective.token_coefficient`, autodiff of the shared objective), then
``dlogits = g * (onehot(id) - softmax(z))`` written in the logits' dtype. Forward + backward move
one read of the logits and one write of dlogits; the backward only applies the loss's cotangent
(:mod:`kernels.grpo_loss.vjp`).

Two families, as :mod:`kernels.grpo_loss.pallas`:
  tiled   (TPU, CPU interpreter): grid (rows / bn,); a [bn, V] row block stays in VMEM (in and
          out, double-buffered: bn from :func:`kernels.grpo_loss.tiles.stats_rows`) and each
          group of 16 rows is swept from VMEM in 128-lane slabs: the statistics
          (:func:`kernels.grpo_loss.tiles.lane_stats`), then -g * softmax written, then each row's
          chosen column patched (ids in SMEM): the logits leave HBM once, dlogits once.
  rowloop (GPU / Triton): grid (rows,); the stats sweep, then the dlogits sweep in reverse chunk
          order, so it starts on the chunks the first sweep read last, the ones still in L2 (a
          297 KB row; :func:`kernels.grpo_loss.blocks.rowloop_budget` models whether the rows
          being swept fit in L2, which decides whether the second sweep costs HBM reads).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jax_core

from kernels import backend, lse
from kernels.grpo_loss import pallas as _pallas
from kernels.grpo_loss import tiles
from kernels.grpo_loss.pallas import LossConfig
from kernels.loss_spec import LossSpec
from kernels.objective import token_coefficient

# Per-token inputs of the in-kernel coefficient, in this order; old / ref / sampler only when given.
TOKEN_FIELDS = ("mask", "advantages", "weight", "old_logps", "ref_logps", "sampler_logps")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Static settings of one training-path call: the kernel's and the loss's."""

  loss: LossConfig  # or a mosaic_gpu.MosaicLossConfig (kernels.grpo_loss.mosaic_train)
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


# ------------------------------------------------------------------------------------ tiled family
def _tiled_train_kernel(ids_ref, x_ref, tok_ref, *out_refs, cfg, rows_per_step):
  """Per group of rows (:mod:`kernels.grpo_loss.tiles`): the statistics sweeps, log p, the
  coefficient g, the dlogits sweep, then each row's chosen column; all from the [bn, V] block in
  VMEM. ids_ref: all N ids in SMEM (the chosen columns' addresses)."""
  logp_ref, ent_ref, lse_ref, shift_ref, dx_ref = out_refs
  bn, v = x_ref.shape
  sw = tiles.sweep_of(v, cfg.loss.temperature, cfg.loss.blocks.block_v, cfg.loss.target.interpret)
  # read at the kernel's top level: the interpreter has no rule for program_id inside its loops
  step_row = pl.program_id(0) * rows_per_step

  def rows_body(rows, size):
    first = step_row + rows.start
    chosen = tiles.gather_chosen(x_ref, rows, size, first, ids_ref, sw)
    m, l, s = lse.merge(*tiles.lane_stats(x_ref, rows, sw, size), axis=1)
    logp, ent, lse_rel, shift = tiles.finalize(m, l, s, chosen, 1.0)
    tok = {k: tok_ref[rows, i : i + 1] for i, k in enumerate(cfg.fields)}
    g = coefficient(cfg, logp, tok)
    tiles.write_grads(x_ref, dx_ref, rows, sw, m, l, g)
    # the chosen column: g * onehot - g * softmax, in the order the sweep's formula had it
    value = jnp.where(g == 0, 0.0, g + (-g / l) * jnp.exp(chosen - m))
    tiles.patch_chosen(dx_ref, rows, size, first, ids_ref, value, sw)
    for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), (logp, ent, lse_rel, shift)):
      ref[rows, :] = val

  tiles.for_row_groups(bn, tiles.row_group(bn, x_ref.dtype), rows_body)


def _tiled_train(cfg: TrainConfig, x, ids, tok):
  n, v = x.shape
  bn = tiles.stats_rows(cfg.loss.blocks.block_n, n, v, x.dtype, cfg.loss.target, blocks=2)
  # the ids ride in SMEM (scalar prefetch, N x 4 bytes): the chosen columns' addresses
  row_spec = pl.BlockSpec((bn, 1), lambda i, ids: (i, 0))
  block = pl.BlockSpec((bn, v), lambda i, ids: (i, 0))
  grid = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(pl.cdiv(n, bn),),
    in_specs=[block, pl.BlockSpec((bn, tok.shape[1]), lambda i, ids: (i, 0))],
    out_specs=[row_spec] * 4 + [block],
  )
  outs = pl.pallas_call(
    functools.partial(_tiled_train_kernel, cfg=cfg, rows_per_step=bn),
    grid_spec=grid,
    out_shape=[jax.ShapeDtypeStruct((n, 1), jnp.float32)] * 4
    + [jax.ShapeDtypeStruct((n, v), x.dtype)],
    # operand 0 is the prefetched ids: the logits are operand 1
    input_output_aliases={1: 4} if cfg.loss.reuse_logits_buffer else {},
    compiler_params=backend.compiler_params(
      cfg.loss.target,
      dimension_semantics=("parallel",),
      vmem_limit_bytes=tiles.vmem_bytes(bn, v, x.dtype, blocks=2),
    ),
    interpret=cfg.loss.target.interpret,
    name="grpo_loss_train",
  )(ids, x, tok)
  return tuple(o.reshape(n) for o in outs[:4]) + (outs[4],)


# ---------------------------------------------------------------------------------- rowloop family
def _rowloop_train_kernel(x_ref, ids_ref, *refs, cfg: TrainConfig):
  k = len(cfg.fields)
  tok = {name: ref[...] for name, ref in zip(cfg.fields, refs[:k])}
  logp_ref, ent_ref, lse_ref, shift_ref, dx_ref = refs[k:]
  token = ids_ref[...]
  logp, ent, lse_rel, shift = _pallas.rowloop_stats(x_ref, token, cfg.loss)
  g = coefficient(cfg, logp, tok)
  _pallas.rowloop_dlogits(x_ref, dx_ref, token, lse_rel, shift, g, cfg.loss, reverse=True)
  for ref, val in zip((logp_ref, ent_ref, lse_ref, shift_ref), (logp, ent, lse_rel, shift)):
    ref[...] = val


def _rowloop_train(cfg: TrainConfig, x, ids, tok):
  n, v = x.shape
  scalar = pl.BlockSpec((None,), lambda i: (i,))
  row = pl.BlockSpec((None, v), lambda i: (i, 0))
  k = tok.shape[1]
  return tuple(
    pl.pallas_call(
      functools.partial(_rowloop_train_kernel, cfg=cfg),
      grid=(n,),
      in_specs=[row] + [scalar] * (1 + k),
      out_specs=[scalar] * 4 + [row],
      out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 4
      + [jax.ShapeDtypeStruct((n, v), x.dtype)],
      input_output_aliases={0: 4} if cfg.loss.reuse_logits_buffer else {},
      compiler_params=_pallas.rowloop_params(cfg.loss),
      interpret=cfg.loss.target.interpret,
      name="grpo_loss_train",
    )(x, ids, *(tok[:, i] for i in range(k)))
  )


def train_fwd(cfg: TrainConfig, x, ids, tok):
  """(logp, entropy, lse_rel, shift [N] f32, dlogits [N, V] in x's dtype) for the loss's cotangent 1.

  x: [N, V] logits; ids: [N] int32; tok: [N, len(cfg.fields)] f32, the per-token inputs.
  """
  if cfg.loss.target.family == "rowloop":
    return _rowloop_train(cfg, x, ids, tok)
  return _tiled_train(cfg, x, ids, tok)
