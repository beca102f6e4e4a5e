"""rl.mismatch against hand-computed float64 values, its micro-batch reduction, and extreme inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.tolerances import assert_close
from rl.mismatch import finish, mismatch_metrics, mismatch_sums, reduce_sums, support_sums

NAN, INF = float("nan"), float("inf")
# Row 0: r = trainer - sampler = (-0.1, 0.5, 0); row 1: (0, -0.8) and a padded token holding garbage;
# row 2: every token masked (garbage, inf and NaN included): none of it may count.
SAMPLER = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0], [-1.0, NAN, 0.0]])
TRAINER = np.array([[-1.1, -1.5, -0.5], [-0.3, -2.0, -7.0], [INF, -3.0, NAN]])
MASK = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
R = [-0.1, 0.5, 0.0, 0.0, -0.8]  # the five masked-in log-ratios, by hand


def _check(got: dict, want: dict):
  assert set(got) == {"mismatch/" + k for k in want}
  for k, v in want.items():
    assert_close(got["mismatch/" + k], v, "f64_check", jnp.float32, len(R), err_msg=k, scale=1.0)


def test_statistics_by_hand_in_float64():
  n = len(R)
  _check(
    mismatch_metrics(SAMPLER, TRAINER, MASK),
    {
      "abs_log_ratio_mean": (0.1 + 0.5 + 0.8) / n,
      "abs_log_ratio_max": 0.8,
      "k3_kl": sum(math.exp(r) - r - 1 for r in R) / n,  # 0.0805775...
      "exp_abs_log_ratio_mean": sum(math.exp(abs(r)) for r in R) / n,
    },
  )


@pytest.mark.parametrize(
  "mode, weights, flagged",
  [
    # token ratios exp(R) = (0.905, 1.649, 1, 1, 0.449), cap 1.2
    ("token_truncate", [math.exp(-0.1), 1.2, 1.0, 1.0, math.exp(-0.8)], 1),
    ("token_mask", [math.exp(-0.1), 0.0, 1.0, 1.0, math.exp(-0.8)], 1),
    # sequence ratios exp(0.4) = 1.492 (row 0, over the cap) and exp(-0.8) = 0.449 (row 1)
    ("sequence_truncate", [1.2, 1.2, 1.2, math.exp(-0.8), math.exp(-0.8)], 3),
    ("sequence_mask", [0.0, 0.0, 0.0, math.exp(-0.8), math.exp(-0.8)], 3),
    # every weight equal to its ratio (a ratio exactly at the cap is kept, not truncated)
    ("sequence_truncate", [math.exp(0.4)] * 3 + [math.exp(-0.8)] * 2, 0),
  ],
)
def test_importance_weight_statistics_by_hand(mode, weights, flagged):
  w = np.zeros(MASK.shape)
  w[MASK] = weights
  w[~MASK] = 7.0  # padding's weight is never read
  got = mismatch_metrics(SAMPLER, TRAINER, MASK, w, is_level=mode.split("_")[0])
  assert_close(got["mismatch/is_weight_mean"], sum(weights) / len(R), "f64_check", jnp.float32, 5)
  assert_close(
    got["mismatch/masked_or_truncated_fraction"], flagged / len(R), "f64_check", jnp.float32, 5
  )


def test_micro_batches_combine_to_the_full_batch():
  w = np.where(MASK, 0.5, 0.0)
  full = mismatch_metrics(SAMPLER, TRAINER, MASK, w)
  parts = [
    mismatch_sums(SAMPLER[i : i + 1], TRAINER[i : i + 1], MASK[i : i + 1], w[i : i + 1])
    for i in range(3)
  ]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *parts)
  for k, v in finish(reduce_sums(stacked)).items():
    assert_close(v, full[k], "f64_check", jnp.float32, 5, err_msg=k)
  assert float(full["mismatch/abs_log_ratio_max"]) == pytest.approx(
    0.8
  )  # a max, not a sum of maxes


def test_no_tokens_and_no_mismatch():
  none = mismatch_metrics(SAMPLER, TRAINER, np.zeros_like(MASK), np.zeros(MASK.shape))
  assert {k: float(v) for k, v in none.items()} == {
    "mismatch/abs_log_ratio_mean": 0.0,
    "mismatch/abs_log_ratio_max": 0.0,
    "mismatch/k3_kl": 0.0,
    "mismatch/exp_abs_log_ratio_mean": 1.0,
    "mismatch/is_weight_mean": 1.0,
    "mismatch/masked_or_truncated_fraction": 0.0,
  }
  same = mismatch_metrics(TRAINER[:2], TRAINER[:2], MASK[:2], np.ones((2, 3)))
  assert (
    float(same["mismatch/k3_kl"]) == 0.0 and float(same["mismatch/exp_abs_log_ratio_mean"]) == 1.0
  )


def test_a_stale_sampler_gives_finite_statistics():
  """A sampler 100 nats off (stale weights) saturates exp at |r| = 60 instead of overflowing."""
  s = np.full((4, 64), -100.0)
  got = mismatch_metrics(s, np.full((4, 64), -0.1), np.ones((4, 64), bool), np.ones((4, 64)))
  assert all(np.isfinite(float(v)) for v in got.values())
  assert float(got["mismatch/abs_log_ratio_max"]) == pytest.approx(99.9)
  assert float(got["mismatch/masked_or_truncated_fraction"]) == 1.0  # weight 1, ratio e^99.9


def test_bad_input_names_the_argument():
  with pytest.raises(ValueError, match=r"sampler_logps \(2, 3\), trainer_logps \(3, 3\)"):
    mismatch_sums(SAMPLER[:2], TRAINER, MASK)
  with pytest.raises(ValueError, match="is_weight"):
    mismatch_sums(SAMPLER, TRAINER, MASK, np.ones((3, 2)))
  with pytest.raises(ValueError, match="is_level must be one of"):
    mismatch_sums(SAMPLER, TRAINER, MASK, is_level="tokens")


def test_raw_and_truncated_ratios_by_hand():
  """mismatch/raw/* and mismatch/truncated/*: the ratio's mean, the tails outside the clip range
  [1 - epsilon_low, 1 + epsilon_high] and k3 KL, over masked tokens only, by hand. The raw side
  carries the kept mass (log 0.75 per token here), the truncated one none. Catches the two sides
  swapped, a tail counted against the wrong epsilon, and padded garbage (inf, NaN) counted."""
  s = np.array([[-1.0, -2.0, NAN], [-0.5, INF, 0.0]])
  trunc = np.array([[-1.0, -2.3, 0.0], [-0.4, 0.0, NAN]])
  raw = trunc + np.log(0.75)
  m = np.array([[1, 1, 0], [1, 0, 0]], bool)
  sums = mismatch_sums(s, trunc, m) | support_sums(s, raw, trunc, m, 0.2, 0.1)
  got = finish(reduce_sums({k: jnp.asarray(v)[None] for k, v in sums.items()}))
  r_t = np.array([0.0, -0.3, 0.1])
  for side, r in (("truncated", r_t), ("raw", r_t + math.log(0.75))):
    rho = np.exp(r)
    want = {
      "ratio_mean": rho.mean(),
      "below_fraction": (rho < 0.8).mean(),
      "above_fraction": (rho > 1.1).mean(),
      "k3_kl": (rho - r - 1).mean(),
    }
    for k, v in want.items():
      np.testing.assert_allclose(float(got[f"mismatch/{side}/{k}"]), v, rtol=1e-5, err_msg=k)
  assert float(got["mismatch/raw/below_fraction"]) == pytest.approx(
    2 / 3
  )  # 0.75, 0.56 < 0.8 < 0.83
