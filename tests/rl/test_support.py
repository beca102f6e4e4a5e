"""rl.support: the loop's sampled-support scoring. The old-policy pass with the engine's gaps and with
gaps replayed (sglang_jax) against the engine's own log-probs, the loss wrappers against the
reference, -inf gaps (nothing filtered, an environment's tokens) never NaN, and the end-to-end
mismatch metrics of a filtered run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels
from bench.tolerances import assert_close
from kernels.grpo_loss import grpo_loss_reference
from rl import support, train
from rl.logging.metrics import read_metrics
from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, SamplingParams, make_engine
from rl.rollout.multiturn import ENV, MODEL, PROMPT, Episode, pack_episodes
from rl.update import pack
from tests.rl.test_train import TINY

TOP = dict(top_k=20, top_p=0.9, min_p=0.0)


@pytest.fixture(scope="module")
def rollout():
  """A filtered rollout of the tiny f32 model (paged engine) packed as the loop packs it."""
  model = scale_weights(init_model(preset("tiny", dtype="float32"), seed=0), 10.0)
  engine = make_engine(model, EngineConfig(backend="paged", max_seq_len=64, max_slots=4))
  rng = np.random.default_rng(0)
  prompts = [list(map(int, rng.integers(3, 300, size=n))) for n in (5, 11, 8)]
  sp = SamplingParams(max_new_tokens=10, temperature=0.9, n=2, seed=1, **TOP)
  result = engine.generate(prompts, sp)
  tokens, mask = pack(
    [c.prompt_ids for c in result.completions],
    [c.token_ids for c in result.completions],
    12,
    10,
    0,
  )
  _, cmask, logps = result.padded(10)
  k = lambda x: jnp.asarray(x)[None]  # one micro-batch: [1, M, ...]
  graphdef, params = nnx.split(model)
  return dict(
    graphdef=graphdef,
    params=params,
    tokens=k(tokens),
    attn=k(mask),
    cmask=cmask,
    logps=logps,
    gaps=result.padded_gaps(10),
    k=k,
  )


def test_old_policy_pass_scores_the_engines_tokens_over_their_support(rollout):
  """With the engine's gaps, and with gaps replayed on the trainer's own logits (what the loop does
  for sglang_jax), the truncated log-probs equal the engine's (on-policy, f32: the teacher-forced
  logits round like the engine's to ~1e-6), while the raw (full-softmax) ones are biased below.
  Catches a replay that uses another filter rule than the sampler (another set, another log-prob),
  gaps read from the wrong rows, and a pass that returns raw log-probs as truncated."""
  r = rollout
  args = (r["graphdef"], r["params"], r["tokens"], r["attn"], 10, 0.9)
  given = support.support_pass(*args, None, r["k"](r["gaps"]))
  replayed = support.support_pass(*args, (20, 0.9, 0.0))
  m = r["cmask"]
  for truncated, raw, gaps in (given, replayed):
    truncated, raw, gaps = (np.asarray(x)[0] for x in (truncated, raw, gaps))
    np.testing.assert_allclose(truncated[m], r["logps"][m], atol=1e-4, rtol=0)
    assert (raw[m] <= truncated[m] + 1e-6).all() and (raw[m] < truncated[m] - 1e-3).any()
    assert (gaps[~m] == -np.inf).all() and np.isfinite(gaps[m]).all()
  # the replay forms the engine's own gaps (up to the ulp the engine may have lowered them by)
  np.testing.assert_allclose(
    np.asarray(replayed[2])[0][m], r["gaps"][m], atol=1e-4 * np.abs(r["gaps"][m]).max()
  )


def _loss_inputs(seed=0, b=3, t=5, v=40):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(b, t, v)) * 3, jnp.float32)
  ids = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  mask = jnp.asarray(rng.random((b, t)) < 0.8)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  old = jnp.asarray(rng.normal(size=(b, t)) * 0.1 - 2.0, jnp.float32)
  gaps = jnp.asarray(-rng.uniform(0, 4, size=(b, t)), jnp.float32)
  gaps = gaps.at[0].set(-jnp.inf)  # a row that filtered nothing
  return logits, ids, mask, adv, old, gaps


def test_loss_wrappers_score_over_the_gaps_and_minus_inf_is_the_plain_loss():
  """rl.support's loss calls: with gaps, the loss and its gradient are the reference's with the same
  gaps (so the gap reaches the backward), and differ from the plain loss; all -inf gaps give the
  plain kernel's loss, finite; the fused-head call equals the logits call. Catches a gap dropped on
  the way to the loss (the loss then equals the plain one), a gap ignored in the backward, and -inf
  gaps turning into NaN."""
  logits, ids, mask, adv, old, gaps = _loss_inputs()
  kw = dict(old_logps=old, loss_type="dapo", loss_scale=0.5, temperature=0.7)
  f = lambda lg, g: kernels.grpo_loss(lg, ids, mask, adv, support_gap=g, **kw)[0]
  ref = lambda lg, g: (
    0.5
    * grpo_loss_reference(
      lg, ids, mask, adv, support_gap=g, **{k: v for k, v in kw.items() if k != "loss_scale"}
    )[0]
  )
  for fn in (f, ref):
    assert np.isfinite(float(fn(logits, gaps)))
  assert_close(f(logits, gaps), ref(logits, gaps), "value", jnp.float32, 40)
  assert_close(jax.grad(f)(logits, gaps), jax.grad(ref)(logits, gaps), "grad", jnp.float32, 40)
  plain = f(logits, None)
  assert abs(float(f(logits, gaps)) - float(plain)) > 1e-4
  off = jnp.full_like(gaps, -jnp.inf)
  assert_close(f(logits, off), plain, "value", jnp.float32, 40)
  assert np.isfinite(np.asarray(jax.grad(f)(logits, off))).all()
  # the fused head: hidden @ weight = logits
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
  weight = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
  fused = kernels.fused_linear_grpo_loss(hidden, weight, ids, mask, adv, support_gap=gaps, **kw)
  assert_close(fused[0], f(hidden @ weight, gaps), "value", jnp.float32, 40)


def test_environment_tokens_get_minus_inf_gaps():
  """An agent's packed rows: MODEL tokens keep the engine's gaps, an environment's tokens (never
  sampled) and padding get -inf, so they are scored over the full softmax. Catches an observation
  token scored with a neighbour's gap, and gaps shifted against the tokens."""
  ep = Episode(0, 0, [1, 2], [PROMPT] * 2, [0.0] * 2, gaps=[-np.inf] * 2)
  ep.tokens += [5, 6, 7, 8, 9]
  ep.roles += [MODEL, MODEL, ENV, ENV, MODEL]
  ep.logps += [-0.1, -0.2, 0.0, 0.0, -0.3]
  ep.gaps += [-1.0, -2.0, -np.inf, -np.inf, -0.5]
  ep.turns += [(2, 4), (6, 7)]
  ep.turn_rewards += [0.0, 1.0]
  packed = pack_episodes([ep], 3, 6, 0)
  np.testing.assert_array_equal(
    packed.support_gaps[0], [-1.0, -2.0, -np.inf, -np.inf, -0.5, -np.inf]
  )
  ep.gaps = None  # an engine that reports none: the update replays them
  assert pack_episodes([ep], 3, 6, 0).support_gaps is None


@pytest.mark.parametrize("backend", ["paged"])
def test_filtered_run_reports_raw_and_truncated_mismatch(tmp_path, backend):
  """A top-p 0.8 run: the truncated ratio's mean is 1 (the trainer scores what the sampler drew
  from), the raw one is below (the log(kept mass) bias), both with their tails and k3 KL. Catches a
  loop that drops the engine's gaps before the update, or scores the truncated side over the full
  softmax."""
  metrics = train.main(
    TINY
    + [
      f"run.out_dir={tmp_path / 'run'}",
      f"rollout.backend={backend}",
      "train.steps=1",
      "sampling.top_p=0.8",
      "eval.every=0",
    ]
  )
  assert metrics is not None
  row = [m for m in read_metrics(str(tmp_path / "run")) if "time/train/step_s" in m][-1]
  for side in ("raw", "truncated"):
    for name in ("ratio_mean", "below_fraction", "above_fraction", "k3_kl"):
      assert np.isfinite(row[f"mismatch/{side}/{name}"]), (side, name)
  assert row["mismatch/truncated/ratio_mean"] == pytest.approx(1.0, abs=2e-3)
  assert row["mismatch/raw/ratio_mean"] < row["mismatch/truncated/ratio_mean"] - 1e-3
  assert row["mismatch/truncated/k3_kl"] < row["mismatch/raw/k3_kl"]


def test_agent_reports_raw_and_truncated_mismatch(tmp_path):
  """rl.agent with a top-p 0.8 sampler reports rl.train's mismatch/* (the engine's log-probs against
  the pre-update pass over model tokens): the truncated ratio's mean is 1, the raw one below it.
  Catches an agent that reports no mismatch, drops the engine's gaps before its old pass, or counts
  an environment's tokens (log-prob 0 on the sampler's side) in the ratios."""
  from rl.agent import __main__ as agent
  from tests.rl.agent.test_env_agent import _cfg

  overrides = ("env.name=grid", "env.max_turns=2", "rollout.max_seq_len=256", "train.steps=1")
  trainer = agent.make_run(_cfg(tmp_path, *overrides, "train.algorithm=grpo", "sampling.top_p=0.8"))
  try:
    trainer.run()
  finally:
    trainer.close()
  row = [m for m in read_metrics(str(tmp_path)) if "train/grad_norm" in m][-1]
  assert row["mismatch/abs_log_ratio_mean"] >= 0 and np.isfinite(row["mismatch/k3_kl"])
  for side in ("raw", "truncated"):
    for name in ("ratio_mean", "below_fraction", "above_fraction", "k3_kl"):
      assert np.isfinite(row[f"mismatch/{side}/{name}"]), (side, name)
  assert row["mismatch/truncated/ratio_mean"] == pytest.approx(1.0, abs=2e-3)
  assert row["mismatch/raw/ratio_mean"] < row["mismatch/truncated/ratio_mean"] - 1e-3
