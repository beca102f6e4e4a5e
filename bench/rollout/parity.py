"""The rollout bench's correctness checks: sampler log-probs against a teacher-forced forward, and
greedy agreement between engines.

Why the gate is a separate float32 run at "highest" matmul precision (issue 34). The H100's bf16 rows
were up to 2.2 nats off the teacher-forced forward while the same code on CPU stays within 0.01 nats:
the engine (cached decode: one-token attention, a scan over layers) and the forward (one pass over the
whole sequence) round at different points, and on the GPU every bf16 op rounds to bf16 (XLA:CPU keeps
bf16 chains in f32 inside its fusions and upcasts bf16 dots). The x10-scaled 0.5B model's logits reach
|z| ~ 35 (measured on CPU: max 33 - 35 over 2 x 64 tokens), so one bf16 ulp of the logits is ~0.27
nats and the H100's 2.2 nats are ~8 of them: rounding amplified through 24 layers of peaked weights.
No bound derived a priori from bf16's rounding separates that from a bug without a GPU measurement of
correct engines, and the tolerance table's "value" entry (relative to |log p|, not to the logits)
does not scale with it at all, so a correct bf16 engine fails it on the GPU. At f32 compute both paths
round at 2^-24 instead of 2^-8; "highest" makes the GPU's f32 dots (XLA's cuBLAS calls and Pallas
Triton's `dot`) run in IEEE f32 rather than TF32 (a 10-bit mantissa; XLA:CPU ignores the setting, so
CPU could never show this). The gap is then the model's own f32 sensitivity, the measured floor
(bench.tolerances.FLOOR_FACTOR), on either platform, while a wrong engine (a shifted position, a
stale page, stale weights) stays nats off (tests/bench/rollout/test_parity_gate.py).
So: the gate is the f32 + "highest" run; the compute-dtype run's divergence is reported beside it, in
nats and in ulps of its dtype at the logits' magnitude (`rounding_ulps`), never gating, until GPU
measurements of correct engines give that unit a bound.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.tolerances import parity_error
from rl.model import init_model
from rl.rollout import RolloutResult, steps
from rl.update import completion_hidden, pack, split_completion, token_logps_and_entropy

GATE_DTYPE = "float32"
GATE_PRECISION = "highest"
RELAYOUT_PAD = 16  # extra left padding of the floor's second teacher-forced forward


@dataclasses.dataclass(frozen=True)
class Parity:
  """One engine run's log-probs against the teacher-forced forward of the same tokens."""

  err: float  # largest error / tolerance (<= 1 passes)
  max_abs_diff: float  # nats
  floor: float  # the forward's own re-layout change, nats (bench.tolerances.FLOOR_FACTOR)
  logit_scale: float  # largest |logit| at a completion position of the forward
  rounding_ulps: float  # max_abs_diff / (eps(compute dtype) * logit_scale)


def gate_model(model):
  """`model`'s weights in a float32-compute twin (the parity gate's model; same parameters)."""
  cfg = model.cfg
  if cfg.dtype == GATE_DTYPE:
    return model
  twin = init_model(dataclasses.replace(cfg, dtype=GATE_DTYPE), seed=0)
  nnx.update(twin, nnx.state(model, nnx.Param))
  return twin


def parity(
  model,
  result: RolloutResult,
  prompt_len: int,
  new_tokens: int,
  rows_per_call: int = 8,
  precision: str | None = None,
) -> Parity:
  """The sampler log-probs (temperature 1, no top-k / top-p) of `result` against `model`'s log-probs
  of the same tokens in one forward pass (the trainer's). `floor`: how far that forward itself moves
  when the rows carry RELAYOUT_PAD more left padding (exact in real arithmetic). `precision`: the
  matmul precision the engine ran under (EngineConfig.matmul_precision); the forward runs under the
  same, so the check never compares an engine at one precision with a forward at another."""
  with steps.precision_scope(precision):
    forward = _forward(model, new_tokens, rows_per_call)
    expected, scale = forward(result, prompt_len)
    relaid, _ = forward(result, prompt_len + RELAYOUT_PAD)
  _, comp_mask, sampler = result.padded(new_tokens)
  expected, actual = expected[comp_mask], sampler[comp_mask]
  floor = float(np.max(np.abs(relaid[comp_mask] - expected), initial=0.0))
  cfg = model.cfg
  diff = float(np.max(np.abs(actual - expected), initial=0.0))
  eps = float(jnp.finfo(cfg.dtype).eps)
  return Parity(
    parity_error(actual, expected, "value", cfg.dtype, cfg.vocab_size, floor),
    diff,
    floor,
    scale,
    diff / max(eps * scale, 1e-30),
  )


def _forward(model, new_tokens: int, rows_per_call: int):
  """result, width -> ([N, C] teacher-forced log-probs, largest |logit| at a completion position)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def rows(st, tokens, mask):  # [R, T] each -> [R, C] log-probs, [R] max |logit|
    m = nnx.merge(graphdef, st)
    ids, cmask = split_completion(tokens, mask, new_tokens)
    logits = m.logits(completion_hidden(m, tokens, mask, new_tokens))  # [R, C, V]
    logp, _ = token_logps_and_entropy(logits, ids, 1.0)
    peak = jnp.where(cmask, jnp.max(jnp.abs(logits), axis=-1), 0.0)
    return jnp.where(cmask, logp, 0.0), jnp.max(peak, axis=-1)

  def run(result: RolloutResult, width: int):
    tokens, mask = pack(
      [c.prompt_ids for c in result.completions],
      [c.token_ids for c in result.completions],
      width,
      new_tokens,
      pad_id=0,
    )
    n = len(tokens)
    pad = -n % rows_per_call  # whole chunks: one compile; [rows, C, V] logits stay small
    tokens = np.concatenate([tokens, np.repeat(tokens[:1], pad, 0)])
    mask = np.concatenate([mask, np.repeat(mask[:1], pad, 0)])
    outs = [
      rows(state, tokens[i : i + rows_per_call], mask[i : i + rows_per_call])
      for i in range(0, len(tokens), rows_per_call)
    ]
    logp = np.concatenate([np.asarray(o[0]) for o in outs])[:n]
    peak = np.concatenate([np.asarray(o[1]) for o in outs])[:n]
    return logp, float(np.max(peak, initial=0.0))

  return run


def teacher_forced_error(
  model, result, prompt_len, new_tokens, rows_per_call=8, precision=None
) -> tuple[float, float, float]:
  """(error / tolerance, largest |difference| in nats, floor) of `parity`."""
  p = parity(model, result, prompt_len, new_tokens, rows_per_call, precision)
  return p.err, p.max_abs_diff, p.floor


def greedy_agreement(a: RolloutResult, b: RolloutResult) -> float:
  """Fraction of completions identical token for token."""
  same = [
    np.array_equal(x.token_ids, y.token_ids)
    for x, y in zip(a.completions, b.completions, strict=True)
  ]
  return sum(same) / len(same)
