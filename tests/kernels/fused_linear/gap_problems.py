"""Gapped fused-head problems: ids drawn as a filtering sampler would (half from each row's top 5,
half anywhere), and the support gap such a sampler reports (:mod:`kernels.support`): a top-k set
(k at least y's rank) cut at the midpoint between its k-th and (k+1)-th scaled logits, a third of the
tokens unfiltered (-inf). A cut whose two logits are closer than ``MARGIN`` is left unfiltered: there
the set is the rounding's choice (the head's kernels sum over H in another order than the reference),
which no sampler's midpoint rule produces at real logit spreads."""

import jax.numpy as jnp
import numpy as np

from tests.kernels.fused_linear.test_fused_linear import make_problem
from tests.problems import policy_kwargs

MARGIN = 1e-2  # scaled-logit distance from the cut that rounding over H (~1e-5 here) never crosses


def sampled_gaps(hidden, lm_head, temperature: float, seed: int):
  """(ids [B, T] int32, gaps [B, T] f32): ids half top-5, gaps of a top-k sampler (midpoint)."""
  rng = np.random.default_rng(seed)
  z = np.asarray(hidden, np.float32) @ np.asarray(lm_head, np.float32) / temperature
  b, t, v = z.shape
  order = np.argsort(-z, axis=-1)
  top = np.take_along_axis(order, rng.integers(0, min(5, v), size=(b, t, 1)), -1)[..., 0]
  ids = np.where(rng.random((b, t)) < 0.5, top, rng.integers(0, v, size=(b, t)))
  zs = -np.sort(-z, axis=-1)
  rank = np.argmax(order == ids[..., None], axis=-1)  # y's 0-based rank
  k = np.minimum(rank + rng.integers(1, 21, size=(b, t)), v)  # the set: y's rank and more
  kth = np.take_along_axis(zs, (k - 1)[..., None], -1)[..., 0]
  nxt = np.take_along_axis(zs, np.minimum(k, v - 1)[..., None], -1)[..., 0]
  zy = np.take_along_axis(z, ids[..., None], -1)[..., 0]
  gap = np.minimum((kth + nxt) / 2 - zy, 0.0)
  loose = (k >= v) | (kth - nxt < 2 * MARGIN) | (rng.random((b, t)) < 1 / 3)
  gap[loose] = -np.inf
  return jnp.asarray(ids, jnp.int32), jnp.asarray(gap, jnp.float32)


def gap_problem(b, t, hd, v, dtype, option: dict, seed: int = 0):
  """make_problem's inputs with sampled ids, their support gaps, and old / reference log-probs near
  the truncated log-probs (the sampler's: a realistic off-policy spread, not a ratio of e^3)."""
  option = dict(option)
  off_policy, beta = option.pop("off_policy", False), option.pop("beta", 0.0)
  args, _ = make_problem(b, t, hd, v, jnp.dtype(dtype), seed=seed)
  temperature = option.get("temperature", 1.0)
  ids, gap = sampled_gaps(args[0], args[1], temperature, seed)
  z = np.asarray(args[0], np.float32) @ np.asarray(args[1], np.float32) / temperature
  zy = np.take_along_axis(z, np.asarray(ids)[..., None], -1)
  keep = (z >= zy + np.asarray(gap)[..., None]) | (np.arange(v) == np.asarray(ids)[..., None])
  top = z.max(-1, keepdims=True)
  lse = np.log(np.where(keep, np.exp(z - top), 0.0).sum(-1, keepdims=True)) + top
  rng = np.random.default_rng(seed + 1)
  kw = policy_kwargs(rng, (zy - lse)[..., 0], option, off_policy=off_policy, beta=beta)
  return (args[0], args[1], ids, *args[3:]), dict(kw, support_gap=gap)
