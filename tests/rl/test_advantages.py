import jax.numpy as jnp
import numpy as np
import pytest

from rl.advantages import advantage_stats, group_advantages


def test_group_advantages_by_hand():
  # group 1: rewards [1, 0, 0, 1] -> mean .5, sample std sqrt(1/3); group 2 all equal -> zeros
  adv = np.asarray(
    group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4, eps=0.0)
  )
  s = np.sqrt(1 / 3)
  np.testing.assert_allclose(adv, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(group_advantages(jnp.array([3.0, 1.0]), 2, scale=False), [1.0, -1.0])
  stats = advantage_stats(
    jnp.array([1.0, 0.0, 2.0, 2.0]), group_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]), 2), 2
  )
  assert stats["advantage/zero_std_group_fraction"] == 0.5


def test_group_advantages_default_eps_by_hand():
  """The default eps = 1e-4 is in the denominator: 0.5 / (sqrt(1/3) + 1e-4), not 0.5 / sqrt(1/3)
  (which differs by 1.7e-4 relative, 170x the tolerance)."""
  adv = np.asarray(group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 4))
  np.testing.assert_allclose(adv, [0.86587543, -0.86587543, -0.86587543, 0.86587543], rtol=1e-6)
  # Dr. GRPO (scale=False) has no eps at all: the centred rewards exactly.
  np.testing.assert_array_equal(
    group_advantages(jnp.array([3.0, 1.0, 2.0, 2.0]), 2, scale=False), [1, -1, 0, 0]
  )


def test_group_advantages_random_groups_are_centred_and_unit_scaled():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(5, 8)).astype(np.float32)
  adv = np.asarray(group_advantages(jnp.asarray(r.reshape(-1)), 8, eps=0.0)).reshape(5, 8)
  np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-6)
  np.testing.assert_allclose(adv.std(axis=1, ddof=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize(
  "rewards,group,match",
  [
    (jnp.zeros(5), 2, "groups of 2"),
    (jnp.zeros((2, 2)), 2, "flat"),
    (jnp.zeros(3), 1, "too small"),
  ],
)
def test_group_advantages_bad_input(rewards, group, match):
  with pytest.raises(ValueError, match=match):
    group_advantages(rewards, group)
