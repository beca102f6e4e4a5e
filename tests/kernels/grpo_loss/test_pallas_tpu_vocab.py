"""The vocab-tiled statistics' two kernels (kernels.grpo_loss.pallas_tpu_vocab) in the CPU interpreter:
the one-sweep kernel against the chosen logit, its row flags, and the exact kernel it falls back to."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.tolerances import assert_close
from kernels import lse
from kernels.backend import Target
from kernels.grpo_loss import LossBlocks, pallas_tpu_vocab
from kernels.grpo_loss.pallas_blocks import LossConfig
from kernels.grpo_loss.reference import token_logps_and_entropy

N, V = 12, 700  # 3 tiles of 256 columns, the last ragged (188); 2 row blocks of 8, the last ragged


def _cfg(temperature=1.0):
  blocks = LossBlocks(8, 256, vocab_tiled=True)
  return LossConfig(Target("cpu", True), blocks, V, temperature)


def _problem(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(N, V)) * 3.0).astype(np.float32)
  ids = rng.integers(0, V, size=N).astype(np.int32)
  return x, ids, dtype


def _both(cfg, x, ids):
  x = jnp.asarray(x)
  chosen = lse.chosen_logit(x, jnp.asarray(ids), V, cfg.temperature)[:, None]  # NaN: out of range
  *fast, flags = pallas_tpu_vocab._stats_call(cfg, x, chosen, [], exact=False)
  exact = pallas_tpu_vocab._stats_call(cfg, x, chosen, [], exact=True)
  return fast, np.asarray(flags)[:, 0], exact


def _assert_matches_reference(cfg, x, ids, dtype=jnp.float32):
  logp, ent, lse_rel, shift = pallas_tpu_vocab.fwd(cfg, jnp.asarray(x, dtype), jnp.asarray(ids))
  ref_logp, ref_ent = token_logps_and_entropy(
    jnp.asarray(x, dtype), jnp.asarray(ids), cfg.temperature
  )
  assert_close(logp, ref_logp, "value", jnp.float32, V, "logp")
  assert_close(ent, ref_ent, "value", jnp.float32, V, "entropy")
  lse_ref = jax.nn.logsumexp(jnp.asarray(x, jnp.float32) / cfg.temperature, axis=1)
  assert_close(shift + lse_rel, lse_ref, "value", jnp.float32, V, "lse")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_sweep_equals_the_exact_kernel_and_flags_nothing(temperature):
  """Catches: a tile's sums not carried to the next (or a tile folded twice), the temperature
  applied to the logits and not to the reference (or twice), a flag raised on ordinary logits
  (every call would pay both kernels)."""
  cfg = _cfg(temperature)
  x, ids, _ = _problem()
  fast, flags, exact = _both(cfg, x, ids)
  assert not flags.any()
  lse = lambda stats: stats[3] + stats[2]
  for name, a, e in (("logp", fast[0], exact[0]), ("entropy", fast[1], exact[1])):
    assert_close(a, e, "value", jnp.float32, V, name)
  assert_close(lse(fast), lse(exact), "value", jnp.float32, V, "lse")
  _assert_matches_reference(cfg, x, ids)


def test_a_logit_far_above_the_chosen_one_falls_back_to_the_exact_kernel():
  """A logit 120 nats above the chosen one's overflows exp(z - z_y) (a token the policy gives
  p < 1e-50: stale off-policy data, arbitrary labels). Catches: the overflow not flagged (logp
  -inf and entropy NaN returned as if right), the flag of one row sending another row's values
  through the wrong kernel."""
  cfg = _cfg()
  x, ids, _ = _problem(seed=1)
  x[3, (ids[3] + 5) % V] = x[3, ids[3]] + 120.0
  fast, flags, _ = _both(cfg, x, ids)
  assert flags.tolist() == [i == 3 for i in range(N)]
  _assert_matches_reference(cfg, x, ids)
  # the other rows keep their one-sweep values bit for bit (a row never depends on its batch)
  out = pallas_tpu_vocab.fwd(cfg, jnp.asarray(x), jnp.asarray(ids))
  for a, f in zip(out, fast):
    np.testing.assert_array_equal(np.delete(np.asarray(a), 3), np.delete(np.asarray(f)[:, 0], 3))


def test_masked_vocabulary_stays_on_the_one_sweep_kernel():
  """-inf logits (a masked vocabulary, a padded tail) give p = 0 and p * (z - z_y) = 0 in the
  one-sweep kernel itself. Catches: the clamp dropped (0 * -inf = NaN: every masked call paying
  the exact kernel too), a masked column counted in the sums."""
  cfg = _cfg()
  x, ids, _ = _problem(seed=2)
  keep = np.zeros_like(x, bool)
  keep[:, :300] = True
  keep[np.arange(N), ids] = True
  x = np.where(keep, x, -np.inf).astype(np.float32)
  _, flags, _ = _both(cfg, x, ids)
  assert not flags.any()
  _assert_matches_reference(cfg, x, ids)


def test_bf16_logits_and_out_of_range_ids():
  """bf16 logits unpacked to f32 in the sweep; an id outside [0, V) poisons its row (NaN log-prob)
  and no other, without the exact kernel (the vocabulary shards that do not hold a token see it so
  on every row). Catches: an out-of-range id read as a wrapped column, its row flagged."""
  cfg = _cfg()
  x, ids, _ = _problem(seed=3)
  x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  ids[5] = V + 3
  chosen = jnp.asarray(np.where(np.arange(N) == 5, np.nan, x[np.arange(N), ids % V]))[:, None]
  *_, flags = pallas_tpu_vocab._stats_call(
    cfg, jnp.asarray(x, jnp.bfloat16), chosen, [], exact=False
  )
  assert not np.asarray(flags).any()
  logp, ent, _, _ = pallas_tpu_vocab.fwd(cfg, jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids))
  assert np.isnan(np.asarray(logp)).tolist() == [i == 5 for i in range(N)]
  ok = np.arange(N) != 5
  ref_logp, ref_ent = token_logps_and_entropy(jnp.asarray(x[ok]), jnp.asarray(ids[ok]), 1.0)
  assert_close(np.asarray(logp)[ok], ref_logp, "value", jnp.float32, V, "logp")
  assert_close(np.asarray(ent)[ok], ref_ent, "value", jnp.float32, V, "entropy")


def test_logits_far_from_zero_stay_on_the_one_sweep_kernel():
  """Every logit shifted by +200 (a model whose logits drift; at T = 0.05 that is what ordinary
  logits become): the sums against each row's chosen logit are as before, nothing is flagged.
  Catches: sums taken against a fixed reference (0) or another row's chosen logit, which overflow
  (all rows flagged: every call paying both kernels) or lose the rows' values."""
  cfg = _cfg()
  x, ids, _ = _problem(seed=4)
  x = x + np.float32(200.0)
  _, flags, _ = _both(cfg, x, ids)
  assert not flags.any()
  _assert_matches_reference(cfg, x, ids)


def test_an_out_of_range_id_over_very_negative_logits_is_redone():
  """An ignore-index row (id outside [0, V): its sums are taken against 0) whose logits all lie
  ~120 below 0: every term underflows (l = 0). Catches: that row returned unflagged (lse -inf,
  entropy NaN against the reference's finite value)."""
  cfg = _cfg()
  x, ids, _ = _problem(seed=5)
  x[2] -= 120.0
  ids[2] = -1
  _, flags, _ = _both(cfg, x, ids)
  assert flags.tolist() == [i == 2 for i in range(N)]
  logp, ent, lse_rel, shift = pallas_tpu_vocab.fwd(cfg, jnp.asarray(x), jnp.asarray(ids))
  assert np.isnan(float(logp[2])) and np.isfinite(np.asarray(ent)).all()
  lse_ref = jax.nn.logsumexp(jnp.asarray(x), axis=1)
  assert_close(shift + lse_rel, lse_ref, "value", jnp.float32, V, "lse")
  _, ref_ent = token_logps_and_entropy(jnp.asarray(x), jnp.asarray(np.maximum(ids, 0)), 1.0)
  assert_close(ent, ref_ent, "value", jnp.float32, V, "entropy")
