"""grpo_loss bench cases: Pallas kernel vs the XLA reference, forward and forward+backward."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import kernels
from bench.kernels.cases import Case, Check
from bench.shapes import LARGE_VOCAB_LOSS_SHAPES, LOSS_SHAPES, PRODUCTION_LOSS_SHAPES, LossShape

SHAPES_BY_SIZE = {
  "tiny": ("tiny",),
  "small": ("cpu-small", "cpu-medium"),
  "large": PRODUCTION_LOSS_SHAPES + LARGE_VOCAB_LOSS_SHAPES,
}


def make_inputs(shape: LossShape, seed: int):
  """Logits, ids, a 90%-dense mask and advantages (on-policy, beta = 0: the common GRPO setting)."""
  k = jax.random.split(jax.random.key(seed), 4)
  b, t, v = shape.batch, shape.seq, shape.vocab
  logits = (jax.random.normal(k[0], (b, t, v), jnp.float32) * 2.0).astype(shape.dtype)
  ids = jax.random.randint(k[1], (b, t), 0, v, jnp.int32)
  mask = jax.random.bernoulli(k[2], 0.9, (b, t))
  adv = jax.random.normal(k[3], (b,), jnp.float32)
  return logits, ids, mask, adv


def gapped_inputs(shape: LossShape, seed: int):
  """:func:`make_inputs` plus support gaps [B, T] f32: -|N(0, 2)| (a top-p-like spread of sampled
  supports), a third -inf (unfiltered tokens)."""
  k = jax.random.split(jax.random.key(seed + 1), 2)
  b, t = shape.batch, shape.seq
  gap = -jnp.abs(jax.random.normal(k[0], (b, t), jnp.float32) * 2.0)
  gap = jnp.where(jax.random.bernoulli(k[1], 1 / 3, (b, t)), -jnp.inf, gap)
  return (*make_inputs(shape, seed), gap)


def _fwd(impl, platform, logits, ids, mask, adv, gap=None, *, blocks=None):
  call = dict(impl=impl, platform=platform, blocks=blocks, support_gap=gap)
  loss, aux = kernels.grpo_loss(logits, ids, mask, adv, **call)
  return loss, aux.per_token_logps


def _fwd_bwd(impl, platform, logits, ids, mask, adv, gap=None, *, blocks=None):
  call = dict(impl=impl, platform=platform, blocks=blocks, support_gap=gap)
  f = lambda x: kernels.grpo_loss(x, ids, mask, adv, **call)[0]
  return jax.value_and_grad(f)(logits)


def cases(size: str, platform: str) -> list[Case]:
  out = []
  for name in SHAPES_BY_SIZE[size]:
    shape = LOSS_SHAPES[name]
    itemsize = jnp.dtype(shape.dtype).itemsize
    n, v = shape.tokens, shape.vocab
    value = Check(0, "value", "float32", v, "loss")
    logps = Check(1, "value", "float32", v, "per_token_logps")
    grad = Check(1, "grad", shape.dtype, v, "dlogits")
    params = dict(batch=shape.batch, seq=shape.seq, vocab=v, tokens=n, dtype=shape.dtype)
    inputs = functools.partial(make_inputs, shape)
    # ideal traffic: one read of the logits forward; one more read plus one write of dlogits backward
    out.append(
      Case(
        "grpo_loss",
        name,
        "fwd",
        inputs,
        functools.partial(_fwd, "pallas", platform),
        functools.partial(_fwd, "xla", platform),
        n * v * itemsize,
        None,
        (value, logps),
        params,
      )
    )
    out.append(
      Case(
        "grpo_loss",
        name,
        "fwd+bwd",
        inputs,
        functools.partial(_fwd_bwd, "pallas", platform),
        functools.partial(_fwd_bwd, "xla", platform),
        # the ideal traffic: the training path reads the logits once and writes dlogits once
        # (kernels/grpo_loss/vjp.py); before the two-pass path this row counted 3 passes
        2 * n * v * itemsize,
        None,
        (value, grad),
        params,
      )
    )
  if platform == "tpu" and size == "large":
    out += _gapped_cases(out, platform)
  return out


def _gapped_cases(plain: list[Case], platform: str) -> list[Case]:
  """qwen2.5-8k's fwd and fwd+bwd with support gaps (issue 48: the kernels gap their own sweeps),
  beside the same rows without: the compiled report's ratio of the two is the gaps' cost."""
  out = []
  for case in plain:
    if case.shape_name != PRODUCTION_LOSS_SHAPES[0]:
      continue
    run = _fwd if case.mode == "fwd" else _fwd_bwd
    out.append(
      dataclasses.replace(
        case,
        mode=f"{case.mode}-gapped",
        make_inputs=functools.partial(gapped_inputs, LOSS_SHAPES[case.shape_name]),
        kernel=functools.partial(run, "pallas", platform),
        reference=functools.partial(run, "xla", platform),
      )
    )
  return out
