"""The tunix drop-in losses against tunix's own ``grpo_loss_fn`` on a tiny real Qwen3 (tied and
untied heads): loss, every parameter gradient and every aux metric, for every loss option tunix has.

Bugs these catch: an aggregation mode mapped to the wrong divisor (tunix divides the sequence modes
by the non-empty rows; an empty row is in every problem), the k1 / k3 / k2 KL estimators swapped, the
GSPO-token gradient taken through the whole sequence, the +-20 clamp or gspo's cap of 10 missing,
sampler_is_weights dropped or applied to the KL term too, the hidden states taken one position off
(the [-T-1:-1] slice), the tied embedding used untransposed, packed rows misaligned by one token.
"""

import pytest

pytest.importorskip("tunix")

import jax.numpy as jnp
import numpy as np
from tunix.rl import algo_core

from kernels.integrations import tunix as grpo_tunix
from tests.integrations import tunix_problems as tp

# Each case turns on options with data that activates them (checked in test_cases_are_active).
CASES = {
  "default_k1": (dict(beta=0.04), dict(temperature=0.9)),
  "token_mean_k3_dual_clip": (
    dict(loss_agg_mode="token-mean", kl_loss_mode="low_var_kl", beta=0.1,
         epsilon_high=0.28, epsilon_c=1.5),
    dict(old_shift=[0, 1.0, 0, 0]),
  ),
  "seq_scale_k2_gspo_cap": (
    dict(loss_agg_mode="sequence-mean-token-scale", kl_loss_mode="mse_kl", loss_algo="gspo-token"),
    dict(old_shift=[0, 15.0, 0, 0]),
  ),
  "seq_sum_weights_on_policy": (
    dict(loss_agg_mode="seq-mean-token-sum", beta=0.04), dict(old=None, weights=True)
  ),
  "sum_norm_gspo_token_adv_kl_logged": (
    dict(loss_agg_mode="sequence-mean-token-sum-norm", loss_algo="gspo-token", beta=0.0),
    dict(token_adv=True),
  ),
  "clamp_20": (dict(beta=0.04, epsilon_c=3.0), dict(old_shift=[0, 25.0, 0, -25.0])),
  "packed_token_mean": (dict(loss_agg_mode="token-mean", beta=0.04), dict(packed=True)),
  "packed_seq_scale_weights": (
    dict(loss_agg_mode="sequence-mean-token-scale", beta=0.04), dict(packed=True, weights=True)
  ),
  "no_ref": (dict(beta=0.04), dict(ref=False)),
}  # fmt: skip

# (fused, impl): the CPU default (the references) and the kernels in the Pallas interpreter.
IMPLS = {
  "logits_xla": (False, "xla"),
  "logits_pallas": (False, "pallas"),
  "fused_chunked": (True, "chunked"),
  "fused_pallas": (True, "pallas"),
}


def _problem(case: str, tied: bool):
  options, ex_kw = CASES[case]
  model = tp.tiny_qwen3(tied)
  temperature = ex_kw.get("temperature", 1.0)
  ex_kw = {k: v for k, v in ex_kw.items() if k != "temperature"}
  ex = tp.example(model, seed=hash(case) % 1000, temperature=temperature, **ex_kw)
  return model, ex, tp.grpo_config(temperature=temperature, **options)


def _ours(fused: bool, impl: str):
  return lambda *a: grpo_tunix.policy_loss(*a, fused=fused, impl=impl)


@pytest.mark.parametrize("case", CASES)
def test_matches_tunix_grpo_loss(case):
  """Every case, untied head, through the production paths (the kernels, interpreted)."""
  model, ex, cfg = _problem(case, False)
  ours = {name: _ours(*IMPLS[name]) for name in ("fused_chunked", "logits_pallas")}
  tp.assert_all_match(algo_core.grpo_loss_fn, ours, model, ex, cfg, f"{case} untied")


@pytest.mark.parametrize("case", ["default_k1", "seq_scale_k2_gspo_cap", "packed_token_mean"])
def test_tied_head_every_impl(case):
  """The tied embedding ([V, D], transposed into the head) through every impl."""
  model, ex, cfg = _problem(case, True)
  ours = {name: _ours(fused, impl) for name, (fused, impl) in IMPLS.items()}
  tp.assert_all_match(algo_core.grpo_loss_fn, ours, model, ex, cfg, f"{case} tied")


def test_cases_are_active():
  """Each case's option changes tunix's loss (so a no-op mapping cannot pass the test above)."""
  model, ex, cfg = _problem("clamp_20", False)
  lp = np.asarray(tp.true_logps(model, ex))
  m = np.asarray(ex.completion_mask) > 0
  assert (np.abs(lp - np.asarray(ex.old_per_token_logps))[m] > 20).any()
  _, aux = tp.loss_and_aux(algo_core.grpo_loss_fn, model, ex, cfg)
  assert float(aux["is_ratio/max"]) == pytest.approx(float(np.exp(np.float32(20.0))), rel=1e-6)
  _, aux = tp.loss_and_aux(algo_core.grpo_loss_fn, *_problem("token_mean_k3_dual_clip", False))
  assert float(aux["pg_clipfrac_lower"]) > 0  # the dual clip bites
  _, aux = tp.loss_and_aux(algo_core.grpo_loss_fn, *_problem("seq_scale_k2_gspo_cap", False))
  assert float(aux["is_ratio/max"]) == pytest.approx(float(np.exp(np.float32(10.0))), rel=1e-6)
  model, ex, cfg = _problem("seq_sum_weights_on_policy", False)
  base = tp.loss_and_aux(algo_core.grpo_loss_fn, model, ex, cfg)[0]
  unweighted = tp.loss_and_aux(algo_core.grpo_loss_fn, model, ex.replace(sampler_is_weights=None), cfg)  # fmt: skip
  assert abs(float(base) - float(unweighted[0])) > 1e-3


def test_register_selects_the_losses_by_name():
  from tunix.rl import function_registry

  grpo_tunix.register(impl="xla", fused_impl="xla")
  model, ex, cfg = _problem("default_k1", True)
  ours = {name: function_registry.get_policy_loss_fn(name) for name in grpo_tunix.GRPO_NAMES}
  tp.assert_all_match(algo_core.grpo_loss_fn, ours, model, ex, cfg, "registered")


@pytest.mark.parametrize(
  ("options", "match"),
  [
    (dict(kl_clamp_value=10.0), "kl_clamp_value"),
    (dict(loss_agg_mode="token-sum"), "loss_agg_mode"),
    (dict(kl_loss_mode="js"), "kl_loss_mode"),
    (dict(epsilon=1.5), "GRPOConfig.epsilon=1.5"),
    (dict(epsilon_c=0.5), "GRPOConfig.epsilon_c=0.5"),
  ],
)
def test_unmappable_options_name_the_key(options, match):
  model, ex, _ = _problem("default_k1", False)
  cfg = tp.grpo_config(**{k: v for k, v in options.items() if k != "kl_clamp_value"})
  if "kl_clamp_value" in options:
    cfg.kl_clamp_value = options["kl_clamp_value"]
  if "loss_agg_mode" in options or "kl_loss_mode" in options:
    cfg.loss_agg_mode = options.get("loss_agg_mode", cfg.loss_agg_mode)
    cfg.kl_loss_mode = options.get("kl_loss_mode", cfg.kl_loss_mode)
  with pytest.raises(ValueError, match=match):
    grpo_tunix.policy_loss(model, ex, cfg, tp.PAD, tp.EOS, fused=True, impl="xla")


def test_negative_sampler_weights_are_rejected():
  model, ex, cfg = _problem("seq_sum_weights_on_policy", False)
  bad = ex.replace(sampler_is_weights=-ex.sampler_is_weights)
  with pytest.raises(ValueError, match="sampler_is_weights must be >= 0"):
    grpo_tunix.policy_loss(model, bad, cfg, tp.PAD, tp.EOS, fused=True, impl="xla")


def test_register_rejects_unknown_impl():
  with pytest.raises(ValueError, match="fused_impl must be one of"):
    grpo_tunix.register(fused_impl="triton")


def test_bf16_model_close_to_tunix():
  """A bf16 model: tunix rounds the logits to bf16 before its f32 softmax, the fused loss keeps them
  in f32 — the two agree to bf16 rounding of the logits (not the f32 targets)."""
  model = tp.tiny_qwen3(False, dtype=jnp.bfloat16)
  ex = tp.example(model, seed=3)
  cfg = tp.grpo_config(beta=0.04)
  e_loss = float(tp.loss_and_aux(algo_core.grpo_loss_fn, model, ex, cfg)[0])
  loss = float(tp.loss_and_aux(_ours(True, "chunked"), model, ex, cfg)[0])
  assert abs(loss - e_loss) <= 2e-2 * max(abs(e_loss), 1e-2)
