"""The k1 / k2 KL estimators and GSPO-token (``LossSpec.kl_estimator``,
``importance_sampling_level="sequence_token"``) through every kernel impl against the reference.

k1 / k2 are token-level: the training kernels derive their in-kernel coefficient by autodiff of the
shared objective (two passes), so a replay that mishandles k1's negation or k2's square fails here.
GSPO-token is sequence-level in value (the three-pass path; the fused chunked impl's statistics pass
then gradient pass). Bugs caught: an impl that ignores the estimator (computes k3 anyway), the
sequence_token level handled as "token" or "sequence" by a kernel path, the cap dropped.
"""

import jax.numpy as jnp
import pytest

from tests.kernels.fused_linear import test_fused_linear as fl
from tests.kernels.grpo_loss.test_grpo_loss import FAMILIES, loss_and_grad, make_problem, pallas_kw
from tests.problems import assert_loss_parity

OPTIONS = {
  "k1": dict(off_policy=True, beta=0.3, kl_estimator="k1", temperature=0.8, epsilon_high=0.28),
  "k2": dict(off_policy=True, beta=0.3, kl_estimator="k2", epsilon_low=0.15),
  "gspo_token_cap_k1": dict(
    off_policy=True,
    beta=0.1,
    kl_estimator="k1",
    importance_sampling_level="sequence_token",
    sequence_log_ratio_cap=0.05,
    epsilon_c=1.5,
  ),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
def test_grpo_loss_parity(family, dtype, option):
  args, kw = make_problem(4, 6, 300, dtype, seed=31, **OPTIONS[option])
  call = pallas_kw(family, FAMILIES[family][1](8, 128))
  for loss_type in ("grpo", "dr_grpo"):
    ours = loss_and_grad(args, kw, loss_type=loss_type, **call)
    ref = loss_and_grad(args, kw, loss_type=loss_type, impl="xla")
    assert_loss_parity(ours, ref, args, kw, f"{family} {option} {loss_type}")


def test_estimators_differ():
  """The three estimators give three different losses on the same data (no silent k3 fallback)."""
  args, kw = make_problem(3, 5, 200, jnp.float32, seed=4, **dict(OPTIONS["k1"], kl_estimator="k3"))
  losses = {
    e: float(loss_and_grad(args, dict(kw, kl_estimator=e), impl="xla")[0])
    for e in ("k1", "k2", "k3")
  }
  assert len({round(v, 6) for v in losses.values()}) == 3, losses


@pytest.mark.parametrize(("impl", "platform"), fl.PATHS)
@pytest.mark.parametrize("option", OPTIONS)
def test_fused_linear_parity(impl, platform, option):
  args, kw = fl.make_problem(3, 5, 16, 300, jnp.float32, seed=7, **OPTIONS[option])
  fl.assert_parity(args, kw, impl, platform, blocks=None)
