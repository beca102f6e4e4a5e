"""What every rollout backend shares: request validation, per-sample bookkeeping, finish rules, and the
host side of a decode chunk. Backends (`paged`, `dense`) add where KV lives and how slots are filled."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rl.kernel_sharding import BATCH_AXES, decode_sharding
from rl.rollout import steps
from rl.rollout.config import EngineConfig
from rl.rollout.sampling import filters, sample_base_keys
from rl.rollout.types import Completion, RolloutResult, RolloutStats, SamplingParams


@dataclasses.dataclass(eq=False)
class Seq:
  """One sample in flight. While running, the cache holds every token but the last generated one,
  which is the next decode step's input: `cached = len(prompt) + len(gen) - 1`."""

  prompt_index: int
  sample_index: int
  prompt: list[int]
  params: SamplingParams
  stop_ids: tuple[int, ...]
  limit: int  # most tokens it may generate: min(max_new_tokens, max_seq_len - len(prompt))
  submitted: float
  gen: list[int] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)
  gaps: list[float] | None = dataclasses.field(default_factory=list)  # None: not reported
  pages: list[int] = dataclasses.field(default_factory=list)
  admitted: float | None = None
  finish: str | None = None
  preemptions: int = 0
  order: int = 0  # admission order (preemption picks the newest)

  @property
  def cached(self) -> int:
    return len(self.prompt) + len(self.gen) - 1

  def completion(self, now: float) -> Completion:
    return Completion(
      self.prompt_index,
      self.sample_index,
      np.asarray(self.prompt, np.int32),
      np.asarray(self.gen, np.int32),
      np.asarray(self.logps, np.float32),
      self.finish,
      queued_s=(self.admitted or now) - self.submitted,
      latency_s=now - self.submitted,
      preemptions=self.preemptions,
      support_gaps=None if self.gaps is None else np.asarray(self.gaps, np.float32),
    )


# The fewest rows a decode chunk has (rl.rollout.paged.decode_rows): what the batch axes must divide.
MIN_DECODE_ROWS = 8


class RolloutEngine:
  """Base: `generate(prompts, params)` -> RolloutResult, one Completion per (prompt, sample).

  The engine keeps a reference to the live model: `generate` reads its current parameters every call,
  so an optimizer update between calls is seen without a copy or a restart.
  """

  # Whether its completions carry support gaps (rl.rollout.types.Completion); an engine that cannot
  # report them (sglang_jax) has the trainer replay its filter on the old policy's logits instead.
  reports_support_gaps = True

  def __init__(
    self,
    model: nnx.Module,
    config: EngineConfig,
    tokenizer=None,
    eos_ids: Sequence[int] | None = None,
  ):
    self.model = model
    self.config = config
    self.tokenizer = tokenizer
    cfg = model.cfg
    if eos_ids is None:
      if tokenizer is not None:
        eos_ids = tokenizer.eos_ids
      else:
        eos = cfg.eos_token_id
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.cache_dtype = jnp.dtype(config.cache_dtype or cfg.dtype)

  def _rollout_graph(self):
    """(graphdef, the live weights in the compute dtype): one cast per generate call, i.e. per weight
    sync, instead of one inside every decode step."""
    graphdef, state = nnx.split(self.model)
    return graphdef, steps.rollout_weights(state, self.model.cfg.compute_dtype)

  def _mesh(self):
    """The mesh the rollout model's weights are laid out on (None: one device)."""
    leaf = jax.tree.leaves(nnx.state(self.model, nnx.Param))[0]
    sharding = getattr(leaf, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None

  def _kv_sharding(self, rank: int, heads_axis: int):
    """Where the KV cache lives: None for a model on one device; with a model on a mesh, the mesh's
    NamedSharding that the jitted steps give the cache anyway (KV heads over "tp" where it divides
    them, as the k / v projections' outputs are, replicated otherwise). A cache created elsewhere (one
    device) takes that sharding after its first decode, so the next prefill, whose cache argument's
    sharding is part of jit's key, would compile again (issue 31)."""
    return kv_sharding(self._mesh(), self.model.cfg.num_kv_heads, rank, heads_axis)

  def _row_sharding(self):
    """The decode chunk's slot layout: rows split over the mesh's batch axes (each device decodes
    its own slots, the paged kernel shard-local over them: rl.kernel_sharding), or None (one
    device, or slot counts the batch axes do not divide: replicated)."""
    return row_sharding(self._mesh(), self.config.max_slots)

  def _kernel_sharding(self):
    """The paged decode kernel's layout: shard-local over the batch axes when the rows are split."""
    return decode_kernel_sharding(self._mesh(), self.model.cfg.num_kv_heads, self.config.max_slots)

  def _precision(self):
    """The matmul precision every jitted step of this engine is traced under (EngineConfig)."""
    return steps.precision_scope(self.config.matmul_precision)

  def _filtered(self, seqs: Sequence[Seq | None]) -> bool:
    """Whether any row filters its distribution: False compiles the plain sampler only."""
    live = [s.params for s in seqs if s is not None]
    return filters(
      [p.top_k for p in live],
      [p.top_p for p in live],
      [p.min_p for p in live],
      self.model.cfg.vocab_size,
    )

  # ----------------------------------------------------------------------------------- requests
  def _requests(self, prompts: Sequence[Sequence[int]], params) -> list[list[Seq]]:
    """Validate and expand requests into their groups of samples."""
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    bad = [type(p).__name__ for p in params if not isinstance(p, SamplingParams)]
    if bad:
      raise TypeError(f"params must be SamplingParams (one, or one per prompt), got {bad[:3]}")
    if len(params) != len(prompts):
      raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    vocab, limit = self.model.cfg.vocab_size, self.config.max_seq_len
    now = time.perf_counter()
    groups = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      prompt = [int(t) for t in prompt]
      if not prompt:
        raise ValueError(f"prompt {i} is empty")
      if len(prompt) >= limit:
        raise ValueError(
          f"prompt {i} has {len(prompt)} tokens; max_seq_len={limit} leaves no room for a "
          "completion (raise rollout max_seq_len or shorten the prompt)"
        )
      bad = [t for t in prompt if not 0 <= t < vocab]
      if bad:
        raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
      if p.stop_strings and self.tokenizer is None:
        raise ValueError("stop_strings need the engine to have a tokenizer")
      stop = tuple(self.eos_ids if p.stop_token_ids is None else p.stop_token_ids)
      groups.append(
        [
          Seq(i, j, prompt, p, stop, min(p.max_new_tokens, limit - len(prompt)), now)
          for j in range(p.n)
        ]
      )
    return groups

  # ----------------------------------------------------------------------------------- finishing
  def _accept(self, seq: Seq, tokens, logps, gaps=None) -> None:
    """Append tokens from the device (with their log-probs and support gaps; `gaps` None: the
    backend reports none) and decide whether the sequence is done."""
    start = len(seq.gen)
    seq.gen.extend(int(t) for t in tokens)
    seq.logps.extend(float(x) for x in logps)
    if gaps is None:
      seq.gaps = None
    elif seq.gaps is not None:
      seq.gaps.extend(float(x) for x in gaps)
    if seq.gen and seq.gen[-1] in seq.stop_ids:
      seq.finish = "eos"
    elif len(seq.gen) >= seq.limit:
      seq.finish = "length"
    if seq.params.stop_strings:
      self._apply_stop_strings(seq, start)

  def _apply_stop_strings(self, seq: Seq, start: int) -> None:
    for end in range(
      max(start, 1), len(seq.gen) + 1
    ):  # the first token that completes a stop string
      text = self.tokenizer.decode(seq.gen[:end])
      if any(s in text for s in seq.params.stop_strings):
        del seq.gen[end:], seq.logps[end:]
        if seq.gaps is not None:
          del seq.gaps[end:]
        seq.finish = "stop"
        return

  # ----------------------------------------------------------------------------------- device inputs
  def _slot_arrays(self, seqs: Sequence[Seq | None]) -> dict[str, jax.Array]:
    """The decode chunk's per-slot inputs; an empty slot gets budget 0 (it idles on page 0)."""
    n = len(seqs)
    k = max([len(s.stop_ids) for s in seqs if s is not None] + [1])
    tokens, positions, generated, budget = (np.zeros(n, np.int32) for _ in range(4))
    stop = np.full((n, k), -1, np.int32)
    seeds, samples = np.zeros(n, np.uint32), np.zeros(n, np.int32)
    temp, topp, topk = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32)
    minp = np.zeros(n, np.float32)
    for i, s in enumerate(seqs):
      if s is None:
        continue
      tokens[i], positions[i], generated[i] = s.gen[-1], s.cached, len(s.gen)
      budget[i] = s.limit - len(s.gen)
      stop[i, : len(s.stop_ids)] = s.stop_ids
      seeds[i], samples[i] = s.params.seed, s.sample_index
      temp[i], topk[i], topp[i] = s.params.temperature, s.params.top_k, s.params.top_p
      minp[i] = s.params.min_p
    arrays = dict(
      tokens=jnp.asarray(tokens),
      positions=jnp.asarray(positions),
      generated=jnp.asarray(generated),
      budget=jnp.asarray(budget),
      stop_ids=jnp.asarray(stop),
      base_keys=sample_base_keys(seeds, samples),
      temperature=jnp.asarray(temp),
      top_k=jnp.asarray(topk),
      top_p=jnp.asarray(topp),
      min_p=jnp.asarray(minp),
    )
    return self._put_rows(arrays)

  def _put_rows(self, tree):
    """Arrays whose leading axis is the decode rows, laid out as `_row_sharding` says."""
    rows = self._row_sharding()
    if rows is None:
      return tree
    return jax.tree.map(
      lambda x: jax.device_put(
        x, NamedSharding(rows.mesh, P(rows.spec[0], *[None] * (x.ndim - 1)))
      ),
      tree,
    )

  @staticmethod
  def _sampling_arrays(seqs: Sequence[Seq]):
    return (
      sample_base_keys([s.params.seed for s in seqs], [s.sample_index for s in seqs]),
      jnp.asarray([s.params.temperature for s in seqs], jnp.float32),
      jnp.asarray([s.params.top_k for s in seqs], jnp.int32),
      jnp.asarray([s.params.top_p for s in seqs], jnp.float32),
      jnp.asarray([s.params.min_p for s in seqs], jnp.float32),
    )

  def _result(self, groups: list[list[Seq]], stats: RolloutStats, t0: float) -> RolloutResult:
    now = time.perf_counter()
    comps = [s.completion(now) for g in groups for s in g]
    stats.prompts, stats.completions = len(groups), len(comps)
    stats.generated_tokens = sum(len(c.token_ids) for c in comps)
    stats.total_s = now - t0
    return RolloutResult(comps, stats)

  def generate(
    self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
  ) -> RolloutResult:
    raise NotImplementedError

  def close(self) -> None:
    """Release what the backend holds outside this process's arrays (sglang_jax: its threads)."""


def kv_sharding(mesh, num_kv_heads: int, rank: int, heads_axis: int):
  """The KV cache's layout on `mesh` (None: one device): KV heads over "tp" where it divides them,
  replicated over the other axes (a decode step's slots read any page)."""
  if mesh is None:
    return None
  tp = mesh.shape.get("tp", 1)
  spec = [None] * rank
  if tp > 1 and num_kv_heads % tp == 0:
    spec[heads_axis] = "tp"
  return NamedSharding(mesh, P(*spec))


def decode_kernel_sharding(mesh, num_kv_heads: int, max_slots: int):
  """The decode kernel's layout (rl.kernel_sharding.decode_sharding) when the rows are split over the
  batch axes (row_sharding), its heads as the pool's (kv_sharding); None otherwise."""
  if row_sharding(mesh, max_slots) is None:
    return None
  heads = kv_sharding(mesh, num_kv_heads, 4, 0).spec
  return decode_sharding(mesh, heads[0] if heads else None)


def row_sharding(mesh, max_slots: int):
  """[rows] split over the mesh's batch axes, when they divide every decode row count (powers of two
  from MIN_DECODE_ROWS up to max_slots); None otherwise (and on one device)."""
  if mesh is None or mesh.size == 1:
    return None
  n = math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)
  if n == 1 or MIN_DECODE_ROWS % n or max_slots % n:
    return None
  return NamedSharding(mesh, P(BATCH_AXES))


def bucket(n: int, minimum: int = 16) -> int:
  """The next power of two >= n (>= minimum): bounded recompiles for ragged prompt batches."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())
