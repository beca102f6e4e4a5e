"""Shared pieces of the loss tests' random problems."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import backend

# The Mosaic GPU kernels' hypothesis shape searches run under the jax of the GPU image (0.11: `nox -s
# tests_jax011`, in CI), where the Mosaic GPU interpreter runs them ~2.5x faster (grpo_loss's 8
# examples: 31 s against 82 s); under jax 0.10 their fixed-shape parity tests run, and the search is
# the same code run again. CI's 55-minute budget has no room for both.
SHAPE_SEARCH_ON_GPU_JAX = pytest.mark.skipif(
  backend.JAX_VERSION < (0, 11),
  reason="the Mosaic GPU shape search runs under jax 0.11 (nox -s tests_jax011)",
)


def policy_kwargs(rng, logp, options: dict, *, off_policy: bool, beta: float) -> dict:
  """The loss keywords: `options`, `beta`, and old / reference log-probs near the current `logp` [B, T]
  (a realistic off-policy gap), drawn from `rng` only when asked for."""
  near = lambda: jnp.asarray(logp + rng.normal(scale=0.25, size=logp.shape), jnp.float32)
  kw = dict(options, beta=beta)
  if off_policy:
    kw["old_logps"] = near()
  if beta:
    kw["ref_logps"] = near()
  return kw


def loss_scale(aux, mask, advantages, kw: dict) -> float:
  """The magnitude the GRPO loss's rounding is relative to: its largest per-token term
  |A| * max(ratio, clip) * max(w, 1) + beta * KL (advantages: [B]). The loss is a weighted mean of such terms of either sign, so it
  can cancel to far below them (a 4.6e-4 loss from O(1) terms failed a check scaled by the result)."""
  logp = np.asarray(aux.per_token_logps, np.float64)
  old = kw.get("old_logps")
  ratio = np.exp(logp - np.asarray(old, np.float64)) if old is not None else np.ones_like(logp)
  ratio = np.maximum(ratio, 1.0 + kw.get("epsilon_high", 0.2))
  weight = getattr(aux, "is_weight", None)  # importance weights (<= is_cap) scale the surrogate
  if weight is not None:
    ratio = ratio * np.maximum(np.asarray(weight, np.float64), 1.0)
  terms = np.abs(np.asarray(advantages, np.float64))[:, None] * ratio
  terms = terms + kw.get("beta", 0.0) * np.abs(np.asarray(aux.per_token_kl, np.float64))
  return float(np.max(np.where(np.asarray(mask), terms, 0.0), initial=0.0))


def epsilon_sensitive_tokens(aux, mask, advantages, kw: dict) -> int:
  """Unmasked tokens whose clipping would change if epsilon_low and epsilon_high were swapped. A parity
  test needs some, or a kernel that mixes the two epsilons up would pass it."""
  old = kw.get("old_logps")
  if old is None:
    return 0
  ratio = np.exp(np.asarray(aux.per_token_logps, np.float64) - np.asarray(old, np.float64))
  a = np.asarray(advantages, np.float64)[:, None]
  lo, hi = kw.get("epsilon_low", 0.2), kw.get("epsilon_high", 0.2)
  clipped = lambda el, eh: ((a > 0) & (ratio > 1 + eh)) | ((a < 0) & (ratio < 1 - el))
  return int(np.sum((clipped(lo, hi) != clipped(hi, lo)) & np.asarray(mask)))


def assert_loss_parity(ours, ref, args, kw, msg: str):
  """(loss, aux, dlogits) of a kernel against the reference's, each on the scale its rounding has."""
  from bench.tolerances import assert_close

  v = args[0].shape[-1]
  scale = max(loss_scale(ref[1], args[2], args[3], kw), float(abs(ref[0])))
  assert_close(ours[0], ref[0], "value", jnp.float32, v, msg, scale=scale)
  for name, a, e in zip(ours[1]._fields, ours[1], ref[1]):
    if name == "is_clipped":
      np.testing.assert_array_equal(a, e, err_msg=msg)
    elif name in ("entropy", "per_token_logps"):
      # lse - E[z] and z_id - lse: differences of logit-sized terms, which set their rounding (an
      # entropy of 0 at V = 1 came out as 1e-9 from logits ~2)
      zmax = float(np.max(np.abs(np.asarray(args[0], np.float32)))) / kw.get("temperature", 1.0)
      aux_scale = max(float(np.max(np.abs(e), initial=0.0)), zmax)
      assert_close(a, e, "value", jnp.float32, v, f"{msg} {name}", scale=aux_scale)
    else:
      assert_close(a, e, "value", jnp.float32, v, f"{msg} {name}")
  assert ours[2].dtype == args[0].dtype
  # dlogits = g (onehot - p): where every p_y ~ 1 (V = 1) all of it cancels to ~0 and its rounding is
  # relative to g, about the loss's largest term over the token count (a token's weight is about
  # 1 / tokens); elsewhere max |dlogits| is the larger scale.
  g_floor = loss_scale(ref[1], args[2], args[3], kw) / (
    kw.get("temperature", 1.0) * max(int(np.sum(np.asarray(args[2]) != 0)), 1)
  )
  grad_scale = max(float(np.max(np.abs(np.asarray(ref[2], np.float64)))), g_floor)
  assert_close(ours[2], ref[2], "grad", args[0].dtype, v, f"{msg} dlogits", scale=grad_scale)
