"""fused_linear_grpo_loss bench cases: the fused kernels (Pallas tiled on TPU / CPU, Mosaic GPU on GPU)
and the chunked path, each against the XLA reference that materialises the logits, forward and
forward+backward."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import kernels
from bench.kernels.cases import Case, Check
from bench.shapes import LINEAR_LOSS_SHAPES, PRODUCTION_LINEAR_LOSS_SHAPES, LinearLossShape
from kernels.fused_linear import mosaic_gpu_blocks

SHAPES_BY_SIZE = {
  "tiny": ("tiny",),
  "small": ("cpu-small", "cpu-mid"),
  "large": PRODUCTION_LINEAR_LOSS_SHAPES,
}


def make_inputs(shape: LinearLossShape, seed: int):
  """Hidden states, an LM head scaled so logits have unit-ish spread, ids, a 90% mask, advantages."""
  k = jax.random.split(jax.random.key(seed), 5)
  b, t, hd, v = shape.batch, shape.seq, shape.hidden, shape.vocab
  hidden = jax.random.normal(k[0], (b, t, hd), jnp.float32).astype(shape.dtype)
  lm_head = (jax.random.normal(k[1], (hd, v), jnp.float32) * 2.0 / hd**0.5).astype(shape.dtype)
  ids = jax.random.randint(k[2], (b, t), 0, v, jnp.int32)
  mask = jax.random.bernoulli(k[3], 0.9, (b, t))
  adv = jax.random.normal(k[4], (b,), jnp.float32)
  return hidden, lm_head, ids, mask, adv


def gapped_inputs(shape: LinearLossShape, seed: int):
  """make_inputs plus support gaps [B, T] f32 (issue 48): -U(0.5, 4) (a top-k / top-p cut a few
  logits below the sampled one), -inf (nothing filtered) for a third of the tokens."""
  k = jax.random.split(jax.random.key(seed + 1), 2)
  shape_bt = (shape.batch, shape.seq)
  gap = -jax.random.uniform(k[0], shape_bt, jnp.float32, 0.5, 4.0)
  gap = jnp.where(jax.random.bernoulli(k[1], 1 / 3, shape_bt), -jnp.inf, gap)
  return (*make_inputs(shape, seed), gap)


def _fwd(impl, platform, hidden, lm_head, ids, mask, adv, gap=None):
  loss, aux = kernels.fused_linear_grpo_loss(
    hidden, lm_head, ids, mask, adv, support_gap=gap, impl=impl, platform=platform
  )
  return loss, aux.per_token_logps


def _fwd_bwd(impl, platform, hidden, lm_head, ids, mask, adv, gap=None, blocks=None):
  f = lambda h, w: kernels.fused_linear_grpo_loss(
    h, w, ids, mask, adv, support_gap=gap, impl=impl, platform=platform, blocks=blocks
  )[0]
  return jax.value_and_grad(f, argnums=(0, 1))(hidden, lm_head)


def impls_for(platform: str) -> tuple[str, ...]:
  """GPU: the Mosaic GPU fused kernels (what impl="pallas" means there; no Triton variant) and the
  chunked path. Elsewhere the tiled Pallas kernels (TPU, or the CPU interpreter) and chunked; the
  Mosaic GPU interpreter is a correctness tool, not a benchmark."""
  return ("mosaic_gpu", "chunked") if platform == "gpu" else ("pallas", "chunked")


def cases(size: str, platform: str) -> list[Case]:
  out = []
  for name in SHAPES_BY_SIZE[size]:
    s = LINEAR_LOSS_SHAPES[name]
    n, hd, v = s.tokens, s.hidden, s.vocab
    item = jnp.dtype(s.dtype).itemsize
    value = Check(0, "value", "float32", hd + v, "loss")
    logps = Check(1, "value", "float32", hd + v, "per_token_logps")
    dh = Check(1, "grad", s.dtype, hd + v, "dhidden")
    dw = Check(2, "grad", s.dtype, n + hd, "dlm_head")
    params = dict(batch=s.batch, seq=s.seq, hidden=hd, vocab=v, tokens=n, dtype=s.dtype)
    inputs = functools.partial(make_inputs, s)
    # ideal traffic: read hidden and the head once (+ write both gradients); flops: the matmuls only,
    # credited as 2 / 6 N·H·V for every impl (mosaic_gpu and pallas recompute: they do 8 / 10)
    io = (n * hd + hd * v) * item
    for impl in impls_for(platform):
      op = f"fused_linear/{impl}"
      out.append(
        Case(
          op,
          name,
          "fwd",
          inputs,
          functools.partial(_fwd, impl, platform),
          functools.partial(_fwd, "xla", platform),
          io,
          2 * n * hd * v,
          (value, logps),
          {**params, "impl": impl},
        )
      )
      out.append(
        Case(
          op,
          name,
          "fwd+bwd",
          inputs,
          functools.partial(_fwd_bwd, impl, platform),
          functools.partial(_fwd_bwd, "xla", platform),
          2 * io,
          6 * n * hd * v,
          (value, dh, dw),
          {**params, "impl": impl},
        )
      )
    if platform == "gpu" and jnp.dtype(s.dtype).name in mosaic_gpu_blocks.DTYPES:
      out.append(_stored_case(name, s, inputs, 2 * io, (value, dh, dw), params))
    if platform == "tpu" and size == "large":
      out.append(_tokamax_case(name, s, inputs, 2 * io, params))
      out += _gapped_cases(name, s, io, ((value, logps), (value, dh, dw)), params)
  return out


def _gapped_cases(name, s: LinearLossShape, io, checks, params) -> list[Case]:
  """The Pallas kernels with support gaps (issue 48: each row's threshold an input of every sweep),
  beside the plain rows: what scoring over the sampled support costs (target <= 1.10x)."""
  inputs = functools.partial(gapped_inputs, s)
  p = {**params, "impl": "pallas", "support_gap": True}
  flops = 2 * s.tokens * s.hidden * s.vocab
  fwd = functools.partial(_fwd, "pallas", "tpu"), functools.partial(_fwd, "xla", "tpu")
  bwd = functools.partial(_fwd_bwd, "pallas", "tpu"), functools.partial(_fwd_bwd, "xla", "tpu")
  return [
    Case("fused_linear/pallas-gapped", name, "fwd", inputs, *fwd, io, flops, checks[0], p),
    Case("fused_linear/pallas-gapped", name, "fwd+bwd", inputs, *bwd, 2 * io, 3 * flops, checks[1], p),
  ]  # fmt: skip


TOKAMAX = "0.0.17"  # the release the peer row is for: it requires jax >= 0.11.1 and Python >= 3.12


def tokamax_unavailable() -> str | None:
  """Why tokamax's TPU linear softmax cross-entropy cannot run beside this jax; None where it can."""
  try:
    import tokamax  # noqa: F401 (an optional peer)
  except ImportError as e:
    return (
      f"tokamax not importable ({e}): tokamax {TOKAMAX} requires jax>=0.11.1 and Python>=3.12, "
      f"this process runs jax {jax.__version__}; pip refuses it beside jax 0.10.2"
    )
  return None


def _tokamax_fwd_bwd(hidden, lm_head, ids, mask, adv):
  """tokamax's fused linear softmax cross-entropy (summed over tokens), value and both gradients:
  the same two GEMMs per tile as our head, without the GRPO terms. Raises with the reason where
  tokamax does not import (the compiled row shows it)."""
  why = tokamax_unavailable()
  if why:
    raise RuntimeError(why)
  import tokamax

  b, t, hd = hidden.shape
  f = lambda h, w: tokamax.linear_softmax_cross_entropy_loss(
    h.reshape(b * t, hd), ids.reshape(b * t), w, reduction="sum"
  )
  return jax.value_and_grad(f, argnums=(0, 1))(hidden, lm_head)


def _tokamax_case(name, s: LinearLossShape, inputs, io, params) -> Case:
  """The peer row: tokamax's forward + backward at the same shape, beside ours and the XLA
  reference (no parity checks: a cross-entropy, not the GRPO loss)."""
  return Case(
    "fused_linear/tokamax",
    name,
    "fwd+bwd",
    inputs,
    _tokamax_fwd_bwd,
    functools.partial(_fwd_bwd, "xla", "tpu"),
    io,
    6 * s.tokens * s.hidden * s.vocab,
    (),
    {**params, "impl": "tokamax", "version": TOKAMAX},
    unavailable=tokamax_unavailable,  # a skipped row with the reason, never a failed one
  )


def _stored_case(name, s: LinearLossShape, inputs, io, checks, params) -> Case:
  """fwd+bwd of the Mosaic GPU path with the most stored columns the temp target allows (the
  statistics pass keeps exp(z - m) of the first columns for the backward): beside the plain
  mosaic_gpu row, what sharing the forward's logits with the backward buys."""
  base = mosaic_gpu_blocks.default_blocks(s.tokens, s.hidden, s.vocab)
  blocks = dataclasses.replace(base, stored_cols=base.max_stored_cols(s.tokens, s.hidden, s.vocab))
  return Case(
    "fused_linear/mosaic_gpu-stored",
    name,
    "fwd+bwd",
    inputs,
    functools.partial(_fwd_bwd, "mosaic_gpu", "gpu", blocks=blocks),
    functools.partial(_fwd_bwd, "xla", "gpu"),
    io,
    6 * s.tokens * s.hidden * s.vocab,
    checks,
    {**params, "impl": "mosaic_gpu", "stored_cols": blocks.stored_cols},
  )
