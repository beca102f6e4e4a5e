"""The multi-turn orchestrator: masks and roles align with the tokens (teacher-forced log-probs on the
packed rows equal the sampler's), episode bookkeeping does not depend on the engine's slots or backend,
finished episodes leave the batch, truncation at max_seq_len, bad input."""

import zlib

import jax
import numpy as np
import pytest

from rl.data.tokenizer import IM_END, ByteTokenizer, chatml
from rl.env.base import StepResult
from rl.model import init_model, preset, scale_weights
from rl.rollout import EngineConfig, SamplingParams, make_engine
from rl.rollout.multiturn import ENV, MODEL, PROMPT, observation_tokens, pack_episodes, rollout
from rl.update import token_logps

TOK = ByteTokenizer()
SEEDS = list(range(7))


class HashEnv:
  """Ends when crc32(reply) % 3 == 0 or after max_turns: episode lengths vary with the replies.
  Logs what it saw and said, so tests can check the tokens against it."""

  def __init__(self, max_turns=4):
    self.max_turns = max_turns
    self.log = []

  def reset(self, seed):
    self.turn, self.log = 0, []
    return f"task {seed}"

  def step(self, action):
    self.turn += 1
    h = zlib.crc32(action.encode())
    done = self.turn >= self.max_turns or h % 3 == 0
    obs = f"obs {self.turn}:{h % 97}"
    self.log.append((action, obs))
    return StepResult(obs, (h % 5) / 4, done, {"success": h % 2 == 0})


def prompt_tokens(obs):
  return TOK.encode(chatml([{"role": "user", "content": obs}]))


@pytest.fixture(scope="module")
def model():
  return scale_weights(init_model(preset("tiny", dtype="float32"), seed=0), 10.0)


def _run(model, backend="paged", slots=8, max_seq_len=256, max_new=6, temperature=0.0, envs=None):
  cfg = EngineConfig(
    backend=backend, max_seq_len=max_seq_len, max_slots=slots, page_size=8, steps_per_sync=4
  )
  engine = make_engine(model, cfg, TOK)
  envs = envs or [HashEnv() for _ in SEEDS]
  params = SamplingParams(max_new_tokens=max_new, temperature=temperature)
  episodes, stats = rollout(
    engine, TOK, envs, SEEDS, [100 + s for s in SEEDS], prompt_tokens, params
  )
  return episodes, stats, envs


@pytest.fixture(scope="module")
def greedy(model):
  return _run(model)


def test_episodes_end_at_different_turns_and_leave_the_batch(greedy):
  episodes, stats, envs = greedy
  turns = [ep.num_turns for ep in episodes]
  assert len(set(turns)) >= 2, turns  # otherwise nothing here tests leaving the batch
  assert stats.engine_calls == max(turns)
  assert all(ep.done and not ep.truncated for ep in episodes)
  # every turn of every episode was one request: the prefill count is the histories' lengths
  assert stats.generated_tokens == sum(sum(r == MODEL for r in ep.roles) for ep in episodes)
  for ep, env in zip(episodes, envs):
    assert len(env.log) == ep.num_turns and ep.turn_rewards == [
      (zlib.crc32(a.encode()) % 5) / 4 for a, _ in env.log
    ]


def test_roles_and_turns_align_with_the_text(greedy):
  episodes, _, envs = greedy
  for ep, env in zip(episodes, envs):
    roles, toks = np.asarray(ep.roles), np.asarray(ep.tokens)
    assert len(toks) == len(roles) == len(ep.logps)
    p = ep.prompt_len
    assert (roles[:p] == PROMPT).all() and toks[:p].tolist() == prompt_tokens(f"task {ep.env_seed}")
    for k, ((start, end), (action, obs)) in enumerate(zip(ep.turns, env.log)):
      assert (roles[start:end] == MODEL).all()
      assert TOK.decode(toks[start:end]) == action  # what the environment was shown
      nxt = ep.turns[k + 1][0] if k + 1 < ep.num_turns else len(toks)
      assert (roles[end:nxt] == ENV).all()
      if k + 1 < ep.num_turns:  # the observation, in ChatML, between two replies
        closed = TOK.decode(toks[start:end], skip_special_tokens=False).endswith(IM_END)
        assert toks[end:nxt].tolist() == observation_tokens(TOK, obs, closed)
        assert f"<|im_start|>user\n{obs}<|im_end|>" in TOK.decode(toks[end:nxt], False)
      else:
        assert end == nxt == len(toks)  # the last reply ends the episode
    assert all(lp == 0.0 for lp, r in zip(ep.logps, roles) if r != MODEL)


def test_packed_rows_score_model_tokens_like_the_sampler(model, greedy):
  """The training forward on the packed rows gives, at every model-mask position, the sampler's
  log-prob of that token: prompt / completion offsets and the mask are aligned (an off-by-one in
  either scores the wrong token and fails by nats)."""
  episodes, _, _ = greedy
  width = max(len(ep.tokens) - ep.prompt_len for ep in episodes)
  packed = pack_episodes(episodes, 32, width + 3, TOK.pad_id)
  lp = np.asarray(
    token_logps(model, packed.tokens, packed.attention_mask, packed.completion_len, 1.0)
  )
  m = packed.model_mask
  assert m.sum() == sum(sum(r == MODEL for r in ep.roles) for ep in episodes)
  np.testing.assert_allclose(lp[m], packed.sampler_logps[m], atol=2e-4)
  assert (packed.sampler_logps[~m] == 0).all()
  # each reward sits on its turn's last model token, nowhere else
  for i, ep in enumerate(episodes):
    ends = [end - 1 - ep.prompt_len for _, end in ep.turns]
    assert np.flatnonzero(packed.rewards[i]).tolist() == [
      e for e, r in zip(ends, ep.turn_rewards) if r != 0
    ]
    assert m[i, ends].all() and packed.rewards[i].sum() == pytest.approx(ep.reward)
    row = packed.tokens[i][packed.attention_mask[i]]
    assert row.tolist() == ep.tokens


@pytest.mark.parametrize("backend, slots", [("paged", 3), ("dense", 8)])
def test_same_episodes_whatever_the_slots_or_backend(model, greedy, backend, slots):
  ref, _, _ = greedy  # paged, 8 slots
  episodes, _, _ = _run(model, backend, slots)
  for a, b in zip(episodes, ref):
    assert a.tokens == b.tokens and a.roles == b.roles and a.turns == b.turns
    assert a.turn_rewards == b.turn_rewards and a.infos == b.infos
    np.testing.assert_allclose(a.logps, b.logps, atol=2e-4)


def test_sampled_episodes_are_seeded(model):
  a, _, _ = _run(model, slots=3, temperature=1.0)
  b, _, _ = _run(model, slots=8, temperature=1.0)
  assert [ep.tokens for ep in a] == [ep.tokens for ep in b]
  assert len({tuple(ep.tokens) for ep in a}) == len(a)


def test_truncation_at_max_seq_len(model):
  episodes, _, _ = _run(model, max_seq_len=64)
  assert any(ep.truncated for ep in episodes)
  for ep in episodes:
    assert len(ep.tokens) <= 64 and ep.done  # a reply may fill the context exactly
    assert ep.roles[-1] == MODEL  # no dangling observation after the last reply


def test_bad_input(model):
  engine = make_engine(model, EngineConfig(backend="dense", max_seq_len=64, max_slots=2), TOK)
  params = SamplingParams(max_new_tokens=2)
  with pytest.raises(ValueError, match="one entry per episode"):
    rollout(engine, TOK, [HashEnv()], [0, 1], [0], prompt_tokens, params)
  env = HashEnv()
  with pytest.raises(ValueError, match="own environment"):
    rollout(engine, TOK, [env, env], [0, 1], [0, 1], prompt_tokens, params)
  with pytest.raises(ValueError, match="max_seq_len=64"):
    rollout(engine, TOK, [HashEnv()], [0], [0], lambda o: [1] * 64, params)
  with pytest.raises(ValueError, match="exceed the widths"):
    episodes, _ = rollout(engine, TOK, [HashEnv()], [0], [0], prompt_tokens, params)
    pack_episodes(episodes, 4, 64, 0)


def test_jax_is_on_cpu():  # the tolerances above are CPU float32 ones
  assert jax.default_backend() == "cpu"
