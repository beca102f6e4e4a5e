"""Tunix's PPO policy-loss options as a :class:`kernels.LossSpec` plus the terms outside it.

Pure: reads the config's attributes; nothing here imports tunix. Tunix's ``ppo_policy_loss_fn``
(0.1.7, ``tunix/rl/algo_core.py``) per token, with per-token (GAE) advantages A [B, T]::

    r = exp(logp - old)                                   (temperature 1: the loss ignores it)
    per_token = max(-A r, -A clip(r, 1 - epsilon_low, 1 + epsilon_high));  dual clip where A < 0
    loss = masked_mean(per_token)                         (over every completion token of the batch)
         - entropy_coef * masked_mean(H(softmax(logits)))  (when entropy_coef is set and != 0)
         + kl_coef * masked_mean(logp - ref)               (when kl_coef > 0 and ref is present)

and its counterpart here:

* ``masked_mean`` over all tokens -> ``loss_type="bnpo"`` (sum / max(tokens, 1); tunix divides by
  tokens + 1e-8, the same number in f32 for any non-empty batch, and 0 for an empty one either way).
* ``epsilon_low`` / ``epsilon_high`` (``PPOConfig.__post_init__`` fills them from ``epsilon``) and
  ``epsilon_c`` -> the spec's fields of the same names.
* ``kl_coef`` (read with ``getattr``, default 0: ``PPOConfig`` has no such field, a subclass may)
  -> ``beta`` with ``kl_estimator="k1"`` (tunix's "kl": logp - ref).
* ``entropy_coef`` is not a LossSpec field (the kernels' entropy carries no gradient): the bonus is
  composed outside the kernel (:mod:`.entropy`), returned here as a float (0.0: off).

Not mappable (ValueError naming the key): ``kl_clamp_value`` while the KL term is on (a clamp of
the KL value). ``beta`` / ``kl_method`` (the learner's KL *reward* penalty), ``gamma`` /
``gae_lambda`` (GAE) and ``clip_range_value`` (the critic) do not enter the policy loss.

One deliberate difference at the edge: LossSpec clamps logp - old (and ref - logp) at +-20 nats
(``max_log_ratio``, the suite's guard), tunix's PPO loss does not clamp — the two differ only for a
token whose log-ratio is beyond 20 nats (ratio > 4.8e8), where tunix's exp overflows to inf past
88 nats and ours stays finite with zero gradient.
"""

from __future__ import annotations

import dataclasses
import math

from kernels.integrations.tunix.options import spec_from_fields
from kernels.loss_spec import LossSpec


@dataclasses.dataclass(frozen=True)
class PPOLoss:
  """The spec of one tunix PPO config and the entropy bonus outside it."""

  spec: LossSpec
  entropy_coef: float  # 0.0: no entropy bonus
  kl: bool  # the k1 KL term is on (spec.beta = kl_coef)


def ppo_loss_from_config(algo_config, *, has_ref: bool) -> PPOLoss:
  """The LossSpec (and entropy coefficient) of tunix's ``ppo_policy_loss_fn`` under ``algo_config``.

  has_ref: whether the example carries ``ref_per_token_logps`` (tunix adds the KL term only then).
  Raises ValueError naming the ``PPOConfig`` key for an option that cannot map or a value LossSpec
  rejects (e.g. ``PPOConfig.epsilon_low=1.0``).
  """
  epsilon = getattr(algo_config, "epsilon", 0.2)
  low = getattr(algo_config, "epsilon_low", None)
  high = getattr(algo_config, "epsilon_high", None)
  kl_coef = getattr(algo_config, "kl_coef", 0.0) or 0.0
  kl = kl_coef > 0.0 and has_ref
  if kl and getattr(algo_config, "kl_clamp_value", None) is not None:
    raise ValueError(
      "PPOConfig.kl_clamp_value is not supported by the ppo_kernels losses while kl_coef > 0 (a "
      "clamp of the KL value; LossSpec clamps ref - logp at +-max_log_ratio instead): set it to None"
    )
  entropy_coef = getattr(algo_config, "entropy_coef", None)
  entropy_coef = 0.0 if entropy_coef is None else entropy_coef
  if not isinstance(entropy_coef, (int, float)) or not math.isfinite(entropy_coef):
    raise ValueError(
      f"PPOConfig.entropy_coef must be a finite number or None, got {entropy_coef!r}"
    )
  fields = dict(
    loss_type="bnpo",
    epsilon_low=("epsilon_low", epsilon if low is None else low),
    epsilon_high=("epsilon_high", epsilon if high is None else high),
    epsilon_c=("epsilon_c", getattr(algo_config, "epsilon_c", None)),
    beta=("kl_coef", kl_coef if kl else 0.0),
    kl_estimator="k1",
  )
  return PPOLoss(spec_from_fields(fields, "PPOConfig"), float(entropy_coef), kl)
