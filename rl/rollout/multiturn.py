"""Synchronous multi-turn rollouts over any RolloutEngine: generate -> environment step -> repeat.

Each turn, every live episode's whole token history (prompt, earlier replies, observations) is one
request of a single `engine.generate` call, so all live episodes of a step decode together (the paged
engine's continuous batching works across them); each reply is decoded to text and handed to its
environment, whose observation is appended as environment tokens in the chat format (a user message
and the next assistant header). An episode leaves the batch when its environment says done, or when
the next observation would leave no room under the engine's `max_seq_len` (then `truncated`).

The engines keep no KV state between `generate` calls, so every turn prefills the episode's history
again: `MultiTurnStats.prefill_tokens` counts that cost (the measured answer to whether KV pages are
kept between turns: they are not, yet).

Every token of an episode carries a role: PROMPT (the first prompt), MODEL (sampled: trained) or ENV
(observations and chat scaffolding: never trained). `pack_episodes` lays episodes out in `rl.update`'s
[left-padded prompt | right-padded rest] rows with a separate model-token (loss) mask.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rl.data.tokenizer import IM_END, chatml
from rl.env.base import Environment
from rl.rollout.engine import RolloutEngine
from rl.rollout.types import SamplingParams

PROMPT, MODEL, ENV = 0, 1, 2
_GOLDEN = 0x9E3779B1  # spreads turn indices over the uint32 seed space


@dataclasses.dataclass
class Episode:
  env_seed: int
  sample_seed: int
  tokens: list[int]
  roles: list[int]  # PROMPT / MODEL / ENV per token
  logps: list[float]  # sampler log-prob on MODEL tokens, 0 elsewhere
  turns: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # [start, end) of replies
  turn_rewards: list[float] = dataclasses.field(default_factory=list)
  infos: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  done: bool = False
  truncated: bool = False  # ended by max_seq_len before the environment ended it
  # support gap per token (kernels.support): the engine's on MODEL tokens, -inf elsewhere (an
  # environment's tokens were never sampled); None: the engine reports none
  gaps: list[float] | None = None

  def add_reply(self, gen: list[int], logps, gaps) -> None:  # gaps: [len(gen)] or None
    """A reply of the model, with the engine's log-probs and support gaps (None: not reported)."""
    start = len(self.tokens)
    self.tokens += gen
    self.roles += [MODEL] * len(gen)
    self.logps += [float(x) for x in logps]
    if self.gaps is not None:
      self.gaps = None if gaps is None else self.gaps + [float(x) for x in gaps]
    self.turns.append((start, len(self.tokens)))

  def add_observation(self, obs: list[int]) -> None:
    """Tokens the environment inserts: never sampled, so no log-prob and a -inf gap."""
    self.tokens += obs
    self.roles += [ENV] * len(obs)
    self.logps += [0.0] * len(obs)
    if self.gaps is not None:
      self.gaps += [-np.inf] * len(obs)

  @property
  def prompt_len(self) -> int:
    return self.turns[0][0] if self.turns else len(self.tokens)

  @property
  def reward(self) -> float:
    return float(sum(self.turn_rewards))

  @property
  def success(self) -> bool:
    return bool(self.infos and self.infos[-1].get("success", False))

  @property
  def num_turns(self) -> int:
    return len(self.turns)


@dataclasses.dataclass
class MultiTurnStats:
  engine_calls: int = 0
  generated_tokens: int = 0
  prefill_tokens: int = 0  # every turn re-prefills the history (no KV kept between calls)
  env_tokens: int = 0
  seconds: float = 0.0
  env_seconds: float = 0.0


def turn_seed(sample_seed: int, turn: int) -> int:
  """The sampling seed of one turn: a function of the episode's seed and the turn alone, so episodes
  do not depend on batching, slots or which other episodes are still live."""
  return (int(sample_seed) + turn * _GOLDEN) % 2**32


def observation_tokens(tokenizer, observation: str, closed: bool) -> list[int]:
  """The environment's turn in ChatML: close the reply (when the model did not), the user message,
  the next assistant header."""
  text = ("" if closed else IM_END) + "\n" + chatml([{"role": "user", "content": observation}])
  return tokenizer.encode(text)


def rollout(
  engine: RolloutEngine,
  tokenizer,
  envs: Sequence[Environment],
  env_seeds: Sequence[int],
  sample_seeds: Sequence[int],
  prompt_tokens: Callable[[str], list[int]],
  params: SamplingParams,
) -> tuple[list[Episode], MultiTurnStats]:
  """Runs one episode per env (`envs[i].reset(env_seeds[i])`) to the end.

  `prompt_tokens(first observation)` renders the first prompt (system + user + assistant header);
  `params` sets each turn's sampling (`max_new_tokens` per reply; its `seed` and `n` are replaced:
  one sample per episode, seeded by `turn_seed(sample_seeds[i], turn)`).
  """
  if not (len(envs) == len(env_seeds) == len(sample_seeds)):
    raise ValueError(
      f"envs, env_seeds and sample_seeds must have one entry per episode, got {len(envs)}, "
      f"{len(env_seeds)} and {len(sample_seeds)}"
    )
  if len({id(e) for e in envs}) != len(envs):
    raise ValueError("each episode needs its own environment instance (they hold its state)")
  t0 = time.perf_counter()
  stats = MultiTurnStats()
  limit = engine.config.max_seq_len
  im_end = tuple(tokenizer.encode(IM_END))
  episodes = []
  for env, env_seed, sample_seed in zip(envs, env_seeds, sample_seeds):
    prompt = list(prompt_tokens(env.reset(env_seed)))
    if len(prompt) >= limit:
      raise ValueError(
        f"episode with env seed {env_seed}: its first prompt has {len(prompt)} tokens, no room under "
        f"rollout max_seq_len={limit}"
      )
    episodes.append(
      Episode(
        int(env_seed),
        int(sample_seed),
        prompt,
        [PROMPT] * len(prompt),
        [0.0] * len(prompt),
        gaps=[-np.inf] * len(prompt),
      )
    )
  live = list(range(len(episodes)))
  while live:
    requests = [
      dataclasses.replace(
        params, n=1, seed=turn_seed(episodes[i].sample_seed, episodes[i].num_turns)
      )
      for i in live
    ]
    result = engine.generate([episodes[i].tokens for i in live], requests)
    stats.engine_calls += 1
    stats.generated_tokens += result.stats.generated_tokens
    stats.prefill_tokens += sum(len(episodes[i].tokens) for i in live)
    t_env = time.perf_counter()
    still = []
    for i, completion in zip(live, result.completions):
      ep, gen = episodes[i], [int(t) for t in completion.token_ids]
      ep.add_reply(gen, completion.logprobs, completion.support_gaps)
      step = envs[i].step(tokenizer.decode(gen))
      ep.turn_rewards.append(float(step.reward))
      ep.infos.append(dict(step.info))
      if step.done:
        ep.done = True
        continue
      closed = tuple(gen[-len(im_end) :]) == im_end
      obs = observation_tokens(tokenizer, step.observation, closed)
      if len(ep.tokens) + len(obs) >= limit:  # no room for another reply
        ep.done = ep.truncated = True
        continue
      ep.add_observation(obs)
      stats.env_tokens += len(obs)
      still.append(i)
    stats.env_seconds += time.perf_counter() - t_env
    live = still
  stats.seconds = time.perf_counter() - t0
  return episodes, stats


@dataclasses.dataclass
class PackedEpisodes:
  """Episodes as [N, P + C] training rows: the first prompt left-padded to P, the rest (replies and
  observations) right-padded to C, the layout of `rl.update.Batch`."""

  tokens: np.ndarray  # [N, P + C] int32
  attention_mask: np.ndarray  # [N, P + C] bool: every real token (prompt, model, env)
  model_mask: np.ndarray  # [N, C] bool: MODEL tokens of the completion part (the trained ones)
  sampler_logps: np.ndarray  # [N, C] f32: the sampler's log-probs on MODEL tokens, 0 elsewhere
  rewards: np.ndarray  # [N, C] f32: each turn's reward on that turn's last MODEL token
  # [N, C] f32: the support gaps of MODEL tokens, -inf elsewhere (environment tokens, padding);
  # None: the engine reports none
  support_gaps: np.ndarray | None = None

  @property
  def completion_len(self) -> int:
    return self.model_mask.shape[1]


def pack_episodes(
  episodes: Sequence[Episode], prompt_width: int, completion_width: int, pad_id: int
) -> PackedEpisodes:
  n, width = len(episodes), prompt_width + completion_width
  tokens = np.full((n, width), pad_id, np.int32)
  attention = np.zeros((n, width), bool)
  model_mask = np.zeros((n, completion_width), bool)
  logps = np.zeros((n, completion_width), np.float32)
  rewards = np.zeros((n, completion_width), np.float32)
  reported = all(ep.gaps is not None for ep in episodes)
  gaps = np.full((n, completion_width), -np.inf, np.float32) if reported else None
  for i, ep in enumerate(episodes):
    p = ep.prompt_len
    rest = len(ep.tokens) - p
    if p > prompt_width or rest > completion_width:
      raise ValueError(
        f"episode {i}: prompt {p} / rest {rest} tokens exceed the widths {prompt_width} / "
        f"{completion_width}"
      )
    tokens[i, prompt_width - p : prompt_width + rest] = ep.tokens
    attention[i, prompt_width - p : prompt_width + rest] = True
    roles = np.asarray(ep.roles[p:], np.int8)
    model_mask[i, :rest] = roles == MODEL
    logps[i, :rest] = np.where(roles == MODEL, np.asarray(ep.logps[p:], np.float32), 0.0)
    if gaps is not None:
      gaps[i, :rest] = np.where(roles == MODEL, np.asarray(ep.gaps[p:], np.float32), -np.inf)
    for (_, end), r in zip(ep.turns, ep.turn_rewards):
      rewards[i, end - 1 - p] += r
  return PackedEpisodes(tokens, attention, model_mask, logps, rewards, gaps)


EPISODE_METRICS = (
  "env/success_rate",
  "env/turns_mean",
  "env/reward_mean",
  "env/truncated_fraction",
  "env/model_tokens_mean",
)


def episode_rows(episodes: Sequence[Episode]) -> np.ndarray:  # [N, len(EPISODE_METRICS)] f64
  """One row per episode, a column per EPISODE_METRICS entry; their means are the metrics (several
  processes gather the rows first)."""
  return np.array(
    [
      [ep.success, ep.num_turns, ep.reward, ep.truncated, sum(r == MODEL for r in ep.roles)]
      for ep in episodes
    ],
    np.float64,
  ).reshape(len(episodes), len(EPISODE_METRICS))
