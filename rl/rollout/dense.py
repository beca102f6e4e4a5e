"""The reference backend: a static batch on a dense KV cache (the way tunix and MLLM-JAX sample).

Rows are prompt x sample pairs (each sample re-prefills its prompt); a batch decodes until its last
row finishes, so short completions idle while long ones run. Same device steps as the paged engine.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl.model.cache import DenseKVCache
from rl.rollout import steps
from rl.rollout.engine import RolloutEngine, Seq, bucket
from rl.rollout.types import RolloutResult, RolloutStats, SamplingParams


class DenseEngine(RolloutEngine):
  def generate(
    self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
  ) -> RolloutResult:
    t0 = time.perf_counter()
    groups = self._requests(prompts, params)
    stats = RolloutStats()
    rows = [s for g in groups for s in g]
    with self._precision():
      graph = self._rollout_graph()
      for i in range(0, len(rows), self.config.max_slots):
        self._run_batch(graph, rows[i : i + self.config.max_slots], stats)
    return self._result(groups, stats, t0)

  @functools.partial(jax.profiler.annotate_function, name="grpo/rollout/batch")
  def _run_batch(self, graph, seqs: list[Seq], stats: RolloutStats) -> None:
    cfg, ecfg = self.model.cfg, self.config
    graphdef, state = graph
    n = len(seqs)
    width = bucket(max(len(s.prompt) for s in seqs))
    max_len = max(width, max(len(s.prompt) + s.limit for s in seqs))
    cache = DenseKVCache.create(
      cfg.num_layers,
      n,
      max_len,
      cfg.num_kv_heads,
      cfg.dim_per_head,
      self.cache_dtype,
      sharding=self._kv_sharding(rank=5, heads_axis=3),
    )
    tokens = np.zeros((n, width), np.int32)
    for i, s in enumerate(seqs):
      tokens[i, : len(s.prompt)] = s.prompt
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (n, width))
    last = jnp.asarray([len(s.prompt) - 1 for s in seqs], jnp.int32)
    t = time.perf_counter()
    for s in seqs:
      s.admitted = t
    logits, cache = steps.prefill(graphdef, state, cache, jnp.asarray(tokens), positions, last)
    first, lps, gaps = jax.device_get(
      steps.sample_first(logits, *self._sampling_arrays(seqs), self._filtered(seqs))
    )
    stats.prefill_s += time.perf_counter() - t
    stats.prefill_tokens += sum(len(s.prompt) for s in seqs)
    for i, s in enumerate(seqs):
      self._accept(s, first[i : i + 1], lps[i : i + 1], gaps[i : i + 1])
    t = time.perf_counter()
    while any(s.finish is None for s in seqs):
      live = [s if s.finish is None else None for s in seqs]
      toks, logps, gaps, emitted, cache = steps.decode_chunk(
        graphdef,
        state,
        cache,
        ecfg.steps_per_sync,
        self._filtered(live),
        **self._slot_arrays(live),
      )
      toks, logps, gaps, emitted = jax.device_get((toks, logps, gaps, emitted))
      stats.decode_steps += ecfg.steps_per_sync
      for i, s in enumerate(live):
        if s is not None:
          self._accept(s, *(x[emitted[:, i], i] for x in (toks, logps, gaps)))
    stats.decode_s += time.perf_counter() - t
