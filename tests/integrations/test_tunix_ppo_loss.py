"""``ppo_kernels`` / ``ppo_kernels_fused`` against tunix's own ``ppo_policy_loss_fn`` on a tiny real
Qwen3 (tied and untied heads): loss, every parameter gradient and every aux metric, over clip
ranges, the dual clip, the entropy bonus and the k1 KL term, with per-token (GAE-shaped) advantages.

Bugs these catch: the reduction taken per sequence instead of over all completion tokens (an
empty row and ragged rows are in every problem), [B, T] advantages read as [B], epsilon_low and
epsilon_high swapped, the dual clip applied where A > 0, the entropy bonus dropped, given the wrong
sign, computed without its gradient or from the hidden states one position off, the KL's sign
(k1 is logp - ref) or estimator wrong, the tied embedding used untransposed, packed rows misaligned
by one token, an unmappable option silently ignored.
"""

import pytest

pytest.importorskip("tunix")

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import algo_core

from kernels.integrations import tunix as grpo_tunix
from tests.integrations import tunix_problems as tp

# (PPOConfig options, example options); each option has data that activates it (test_cases_are_active).
CASES = {
  "defaults": (dict(), dict()),
  "asym_clip_dual_clip": (
    dict(epsilon_low=0.1, epsilon_high=0.28, epsilon_c=1.5),
    dict(old_shift=[0, 1.0, 0, 0]),
  ),
  "wide_clip_entropy": (dict(epsilon=0.3, epsilon_high=0.5, entropy_coef=0.05), dict()),
  "k1_kl_entropy_dual_clip": (
    dict(kl_coef=0.1, entropy_coef=0.02, epsilon_c=3.0, epsilon_high=0.28),
    dict(old_shift=[0, 2.0, 0, 0]),
  ),
  "packed_entropy_kl": (dict(entropy_coef=0.05, kl_coef=0.05), dict(packed=True)),
}
IMPLS = {  # (fused, impl): the CPU default (the references) and the kernels, interpreted
  "logits_xla": (False, "xla"),
  "logits_pallas": (False, "pallas"),
  "fused_xla": (True, "xla"),
  "fused_chunked": (True, "chunked"),
  "fused_pallas": (True, "pallas"),
}


def _problem(case: str, tied: bool, **overrides):
  options, ex_kw = CASES[case]
  model = tp.tiny_qwen3(tied)
  ex = tp.example(model, seed=sum(map(ord, case)) % 1000, token_adv=True, **ex_kw)
  cfg = tp.KLPPOConfig(**(options | overrides))
  return model, tp.ppo_example(ex), cfg


def _ours(fused: bool, impl: str):
  return lambda *a: grpo_tunix.ppo_policy_loss(*a, fused=fused, impl=impl)


@pytest.mark.parametrize("case", CASES)
def test_matches_tunix_ppo_loss(case):
  """Every case, untied head, through the production paths (the kernels, interpreted)."""
  model, ex, cfg = _problem(case, False)
  ours = {name: _ours(*IMPLS[name]) for name in ("fused_chunked", "logits_pallas")}
  tp.assert_all_match(algo_core.ppo_policy_loss_fn, ours, model, ex, cfg, case)


def test_tied_head_every_kernel():
  """The tied embedding ([V, D], transposed into the head and into the entropy's chunks) through
  every kernel path (the XLA references: test_register_selects_the_ppo_losses_by_name), with
  every option on at once."""
  model, ex, cfg = _problem("k1_kl_entropy_dual_clip", True)
  ours = {name: _ours(*IMPLS[name]) for name in ("logits_pallas", "fused_chunked", "fused_pallas")}
  tp.assert_all_match(algo_core.ppo_policy_loss_fn, ours, model, ex, cfg, "tied")


def test_cases_are_active():
  """Each option changes tunix's loss or fires its metric on its case's data (so a no-op mapping
  cannot pass the tests above), and the aux keys appear exactly when tunix's do."""
  loss = lambda case, **over: tp.loss_and_aux(algo_core.ppo_policy_loss_fn, *_problem(case, False, **over))  # fmt: skip
  base = loss("defaults")
  assert float(base[1]["pg_clipfrac"]) > 0 and set(base[1]) == {"pg_clipfrac", "pg_clipfrac_lower"}
  assert float(loss("asym_clip_dual_clip")[1]["pg_clipfrac_lower"]) > 0  # the dual clip bites
  with_all = loss("k1_kl_entropy_dual_clip")
  assert {"kl", "loss/entropy"} <= set(with_all[1])
  for off in (dict(kl_coef=0.0), dict(entropy_coef=0.0), dict(epsilon_high=0.2)):
    assert abs(float(with_all[0]) - float(loss("k1_kl_entropy_dual_clip", **off)[0])) > 1e-4, off


def test_register_selects_the_ppo_losses_by_name():
  """``register()`` puts both PPO names in tunix's registry, where PPOLearner looks them up; the
  XLA references on the tied head. ``kl_clamp_value`` is set: it also clamps the learner's KL
  *reward* penalty, and with kl_coef = 0 the loss has no KL term, so it is not refused."""
  from tunix.rl import function_registry

  grpo_tunix.register(impl="xla", fused_impl="xla")
  model, ex, cfg = _problem("wide_clip_entropy", True, kl_clamp_value=10.0)
  ours = {name: function_registry.default_registry.get("policy_loss_fn", name) for name in grpo_tunix.PPO_NAMES}  # fmt: skip
  tp.assert_all_match(algo_core.ppo_policy_loss_fn, ours, model, ex, cfg, "registered")


def test_stale_old_logps_stay_finite():
  """Old log-probs 100 nats off (a stale or mismatched sampler), no dual clip: tunix's unclamped
  exp overflows to an infinite loss, ours clamps the log-ratio at 20 nats (the one documented
  difference) and stays finite, loss, aux and gradients."""
  model, ex, cfg = _problem("defaults", False)
  ex = ex.replace(old_per_token_logps=ex.old_per_token_logps - 100.0)
  loss, aux, grads = tp.loss_and_grads(_ours(True, "chunked"), model, ex, cfg)
  assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in aux.values())
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert not np.isfinite(float(tp.loss_and_aux(algo_core.ppo_policy_loss_fn, model, ex, cfg)[0]))


@pytest.mark.parametrize(
  ("options", "match"),
  [
    (dict(kl_coef=0.1, kl_clamp_value=10.0), "PPOConfig.kl_clamp_value"),
    (dict(epsilon_low=1.0), r"PPOConfig.epsilon_low=1.0"),
    (dict(entropy_coef=float("nan")), "PPOConfig.entropy_coef"),
  ],
)
def test_unmappable_options_name_the_key(options, match):
  model, ex, _ = _problem("defaults", False)
  with pytest.raises(ValueError, match=match):
    grpo_tunix.ppo_policy_loss(model, ex, tp.KLPPOConfig(**options), tp.PAD, tp.EOS, impl="xla")


def test_sequence_advantages_are_refused():
  """[B] advantages (GRPO's) would broadcast along T in tunix's PPO loss: refused, naming the shape."""
  model, ex, cfg = _problem("defaults", False)
  bad = ex.replace(advantages=ex.advantages[:, 0])
  with pytest.raises(ValueError, match="per-token advantages"):
    grpo_tunix.ppo_policy_loss(model, bad, cfg, tp.PAD, tp.EOS, impl="xla")


def test_bf16_model_close_to_tunix():
  """A bf16 model with the entropy bonus: tunix rounds the logits to bf16 before its f32 softmax,
  the fused loss keeps them in f32 (its entropy chunks follow tunix: bf16, then f32) — the two
  agree to bf16 rounding of the logits, and every gradient (bf16 hidden states, a bf16 head
  gradient from the entropy's chunks) is finite."""
  model = tp.tiny_qwen3(False, dtype=jnp.bfloat16)
  ex = tp.ppo_example(tp.example(model, seed=3, token_adv=True))
  cfg = tp.KLPPOConfig(entropy_coef=0.05, epsilon_c=3.0)
  theirs, ours = tp.losses_and_grads([algo_core.ppo_policy_loss_fn, _ours(True, "chunked")], model, ex, cfg)  # fmt: skip
  assert abs(float(ours[0]) - float(theirs[0])) <= 2e-2 * max(abs(float(theirs[0])), 1e-2)
  assert abs(float(ours[1]["loss/entropy"]) - float(theirs[1]["loss/entropy"])) <= 1e-2
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(ours[2]))
