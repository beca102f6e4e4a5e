"""``LossSpec``: the one validated, hashable description of the policy loss both ops compute.

``grpo_loss``, ``fused_linear_grpo_loss`` and their references take it (``spec=``), the RL loop
carries it, and the kernels receive it as a static (non-differentiable) argument: it is frozen and
hashable, so two equal specs share one compiled program. The public functions' loss keywords
(``beta=``, ``loss_type=``, ...) remain as a convenience that builds a spec (:func:`resolve`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kernels import checks

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_MODES = (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_LEVELS = ("token", "sequence", "sequence_token")
KL_ESTIMATORS = ("k3", "k1", "k2")
DEFAULT_MAX_LOG_RATIO = 20.0  # tunix's bound: exp(20) ~ 4.9e8 keeps every term finite in f32


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """The policy loss (formulas: :func:`kernels.objective.policy_objective`).

  loss_type: the reduction over masked tokens ("grpo" | "bnpo" | "dr_grpo" | "dapo").
  epsilon_low in [0, 1), epsilon_high >= 0: the PPO clip range [1 - epsilon_low, 1 + epsilon_high].
  beta >= 0: weight of the KL to the reference policy (needs ``ref_logps``).
  kl_estimator: the per-token KL estimator, with d = ref - logp: "k3" (exp(d) - d - 1, Schulman's
    low-variance estimator; tunix "low_var_kl"), "k1" (-d = logp - ref; tunix "kl"), "k2"
    (d^2 / 2; tunix "mse_kl").
  temperature > 0: logits are divided by it.
  max_log_ratio > 0 or None: clamp of logp - old and ref - logp before exp (None: no clamp).
  is_mode: importance correction for the sampler's log-probs (needs ``sampler_logps``): None,
    "token_truncate", "token_mask", "sequence_truncate", "sequence_mask".
  is_cap > 0: the truncation / masking threshold of the importance weight.
  importance_sampling_level: "token" (PPO / GRPO), "sequence" (GSPO: the ratio of a sequence's
    masked-mean log-ratio, shared by its tokens) or "sequence_token" (GSPO-token, tunix's
    "gspo-token": the sequence's ratio as a value, each token's own log p for the gradient).
  sequence_log_ratio_cap > 0 or None: with "sequence_token", the upper clamp of the sequence's
    log-ratio (tunix clamps it at 10), zero gradient beyond.
  epsilon_c > 1 or None: dual-clip PPO; where A < 0 the per-token loss is capped at c * |A|.
  max_completion_length: positive int or None, dr_grpo's divisor (default T).
  """

  loss_type: str = "grpo"
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  beta: float = 0.0
  temperature: float = 1.0
  max_log_ratio: float | None = DEFAULT_MAX_LOG_RATIO
  is_mode: str | None = None
  is_cap: float = 2.0
  importance_sampling_level: str = "token"
  epsilon_c: float | None = None
  max_completion_length: int | None = None
  kl_estimator: str = "k3"
  sequence_log_ratio_cap: float | None = None

  def __post_init__(self):
    checks.choice("loss_type", self.loss_type, LOSS_TYPES)
    checks.choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    checks.choice("is_mode", self.is_mode, IS_MODES)
    checks.choice("importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
    checks.positive_int("max_completion_length", self.max_completion_length, allow_none=True)
    reals = dict(
      epsilon_low=checks.real("epsilon_low", self.epsilon_low, lo=0.0, hi=1.0, hi_open=True),
      epsilon_high=checks.real("epsilon_high", self.epsilon_high, lo=0.0),
      beta=checks.real("beta", self.beta, lo=0.0),
      temperature=checks.real("temperature", self.temperature, lo=0.0, lo_open=True),
      is_cap=checks.real("is_cap", self.is_cap, lo=0.0, lo_open=True),
    )
    if self.max_log_ratio is not None:
      reals["max_log_ratio"] = checks.real(
        "max_log_ratio", self.max_log_ratio, lo=0.0, lo_open=True
      )
    if self.epsilon_c is not None:
      reals["epsilon_c"] = checks.real("epsilon_c", self.epsilon_c, lo=1.0, lo_open=True)
    if self.sequence_log_ratio_cap is not None:
      if self.importance_sampling_level != "sequence_token":
        raise ValueError(
          "sequence_log_ratio_cap needs importance_sampling_level='sequence_token', got "
          f"{self.importance_sampling_level!r}"
        )
      reals["sequence_log_ratio_cap"] = checks.real(
        "sequence_log_ratio_cap", self.sequence_log_ratio_cap, lo=0.0, lo_open=True
      )
    # Python floats (not ints / numpy scalars), so that equal specs hash equal.
    for name, value in reals.items():
      object.__setattr__(self, name, value)

  @property
  def sequence_level(self) -> bool:
    """True when a token's loss depends on other tokens of its sequence (GSPO, GSPO-token or a
    sequence IS mode): the loss weights of a token are then known only once the whole sequence's
    log-probs are (GSPO-token's gradient is per token, but its value is the sequence's ratio)."""
    return self.importance_sampling_level != "token" or (
      self.is_mode is not None and self.is_mode.startswith("sequence")
    )


class _Unset:
  """The default of a public loss keyword: "not given", distinct from every legal value (None
  included: ``max_log_ratio=None`` disables the clamp)."""

  def __repr__(self):
    return "UNSET"


UNSET: Any = _Unset()
FIELDS = tuple(f.name for f in dataclasses.fields(LossSpec))


def resolve(spec: LossSpec | None, **options) -> LossSpec:
  """The spec of a call: ``spec`` (default ``LossSpec()``) with the keywords that were given.

  A keyword given together with ``spec`` must agree with it: a conflicting value is a ValueError
  (which one was meant is ambiguous). Raises the spec's own ValueError for a bad value.
  """
  if spec is not None and not isinstance(spec, LossSpec):
    raise checks.ArgumentTypeError(f"spec must be a kernels.LossSpec, got {type(spec).__name__}")
  given = {k: v for k, v in options.items() if v is not UNSET}
  unknown = set(given) - set(FIELDS)
  if unknown:
    raise TypeError(f"unknown loss options {sorted(unknown)}; LossSpec fields are {FIELDS}")
  if spec is None:
    return LossSpec(**given)
  merged = dataclasses.replace(spec, **given)
  for name in given:
    if getattr(merged, name) != getattr(spec, name):
      raise ValueError(
        f"{name}={given[name]!r} conflicts with spec.{name}={getattr(spec, name)!r}: pass the "
        "option in the spec or as a keyword, not both"
      )
  return spec
