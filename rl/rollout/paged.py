"""The paged engine: continuous batching over a fixed number of decode slots on the paged KV cache.

Each scheduling round: (1) admit work into free slots — preempted sequences first, then new requests,
a request's whole group at once — and prefill it in one batched call (a group's samples share the
prompt's full pages and copy only its partial last page); (2) give every running sequence the pages
its next `steps_per_sync` tokens need, preempting the newest sequences when the pool runs dry (they
are recomputed later from their tokens: nothing is lost or cut); (3) run one decode chunk; (4) retire
finished sequences, freeing their slots and pages for the next round.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.rollout import steps
from rl.rollout.engine import RolloutEngine, Seq, bucket
from rl.rollout.paged_cache import NULL_PAGE, PagedKVCache, PagePool
from rl.rollout.types import RolloutResult, RolloutStats, SamplingParams


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


class PagedEngine(RolloutEngine):
  def __init__(self, model, config, tokenizer=None, eos_ids=None):
    super().__init__(model, config, tokenizer, eos_ids)
    cfg = model.cfg
    self._cache = PagedKVCache.create(
      cfg.num_layers,
      config.pool_pages,
      config.page_size,
      cfg.num_kv_heads,
      cfg.dim_per_head,
      self.cache_dtype,
      config.attn_impl,
    )

  def generate(
    self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
  ) -> RolloutResult:
    t0 = time.perf_counter()
    groups = self._requests(prompts, params)
    too_big = [g[0].prompt_index for g in groups if len(g) > self.config.max_slots]
    if too_big:
      raise ValueError(
        f"prompt(s) {too_big[:5]} ask for more samples than max_slots="
        f"{self.config.max_slots}: a group is decoded together"
      )
    self._graph = nnx.split(self.model)  # the live parameters, by reference
    self._pool = PagePool(self.config.pool_pages)
    self._slots: list[Seq | None] = [None] * self.config.max_slots
    self._waiting = collections.deque(groups)
    self._resume: collections.deque[Seq] = collections.deque()
    self._order = 0
    stats = RolloutStats()
    while self._waiting or self._resume or any(self._slots):
      self._admit(stats)
      if not any(self._slots):
        raise RuntimeError(
          "no sequence could be admitted: the page pool is smaller than one request needs "
          f"({self._pool.free} pages free); raise rollout num_pages"
        )
      self._reserve(stats)
      self._decode(stats)
    return self._result(groups, stats, t0)

  # ----------------------------------------------------------------------------------- admission
  def _admit(self, stats: RolloutStats) -> None:
    ps, k = self.config.page_size, self.config.steps_per_sync
    free_slots = [i for i, s in enumerate(self._slots) if s is None]
    running = len(self._slots) - len(free_slots)
    rows: list[
      tuple[Seq, list[int]]
    ] = []  # (sequence whose pages receive the tokens, tokens to cache)
    copies: list[tuple[int, int]] = []
    new_groups: list[list[Seq]] = []

    def headroom(seqs: int) -> int:
      """Pages kept free for the running sequences' next chunk, so admission does not force an
      immediate preemption; none when the engine is idle (the first work must always get in)."""
      return 0 if running == 0 and not rows else seqs * _cdiv(k, ps)

    while self._resume and free_slots:
      seq = self._resume[0]
      need = _cdiv(seq.cached, ps)
      if self._pool.free < need + headroom(running + 1):
        break
      self._resume.popleft()
      seq.pages = self._pool.alloc(need)
      self._place(seq, free_slots.pop(0))
      rows.append((seq, seq.prompt + seq.gen[:-1]))
      running += 1
    while self._waiting and not self._resume and len(free_slots) >= len(self._waiting[0]):
      group = self._waiting[0]
      plen = len(group[0].prompt)
      full, partial = plen // ps, plen % ps > 0
      need = full + partial + (len(group) - 1) * partial
      if self._pool.free < need + headroom(running + len(group)):
        break
      self._waiting.popleft()
      lead = group[0]
      lead.pages = self._pool.alloc(full + partial)
      for seq in group[1:]:
        self._pool.share(lead.pages[:full])
        seq.pages = lead.pages[:full] + (self._pool.alloc(1) if partial else [])
        if partial:
          copies.append((lead.pages[-1], seq.pages[-1]))
      for seq in group:
        self._place(seq, free_slots.pop(0))
      rows.append((lead, lead.prompt))
      new_groups.append(group)
      running += len(group)
    if rows:
      self._prefill(rows, copies, new_groups, stats)

  def _place(self, seq: Seq, slot: int) -> None:
    self._slots[slot] = seq
    seq.admitted = seq.admitted or time.perf_counter()
    seq.order, self._order = self._order, self._order + 1

  @functools.partial(jax.profiler.annotate_function, name="grpo/rollout/prefill")
  def _prefill(self, rows, copies, new_groups, stats: RolloutStats) -> None:
    t = time.perf_counter()
    width = min(
      bucket(max(len(toks) for _, toks in rows)), self.config.pages_per_seq * self.config.page_size
    )
    n = bucket(len(rows), minimum=1)
    tokens = np.zeros((n, width), np.int32)
    last = np.zeros(n, np.int32)
    table = np.full((n, self.config.pages_per_seq), NULL_PAGE, np.int32)
    lead_row = {}
    for i, (seq, toks) in enumerate(rows):
      tokens[i, : len(toks)] = toks
      last[i] = len(toks) - 1
      table[i, : len(seq.pages)] = seq.pages
      lead_row[id(seq)] = i
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (n, width))
    cache = self._cache.with_table(jnp.asarray(table))
    logits, cache = steps.prefill(
      *self._graph, cache, jnp.asarray(tokens), positions, jnp.asarray(last)
    )
    if copies:
      src, dst = zip(*copies)
      cache = steps.copy_pages(cache, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    self._cache = cache
    seqs = [s for g in new_groups for s in g]
    if seqs:  # each sample of a new group draws its first token from its prompt's logits
      idx = jnp.asarray([lead_row[id(g[0])] for g in new_groups for _ in g], jnp.int32)
      first, lps = jax.device_get(steps.sample_first(logits[idx], *self._sampling_arrays(seqs)))
      for i, s in enumerate(seqs):
        self._accept(s, first[i : i + 1], lps[i : i + 1])
    else:
      jax.block_until_ready(cache.k)
    stats.prefill_s += time.perf_counter() - t
    stats.prefill_tokens += sum(len(toks) for _, toks in rows)
    self._retire()

  # ----------------------------------------------------------------------------------- pages
  def _reserve(self, stats: RolloutStats) -> None:
    """Pages for every running sequence's next chunk; preempt the newest until they fit."""
    ps, k = self.config.page_size, self.config.steps_per_sync
    while True:
      running = [s for s in self._slots if s is not None]
      want = {
        id(s): _cdiv(min(s.cached + k, len(s.prompt) + s.limit - 1), ps) - len(s.pages)
        for s in running
      }
      short = sum(max(w, 0) for w in want.values()) - self._pool.free
      if short <= 0:
        break
      if len(running) == 1:  # cannot happen with a valid config: one sequence always fits
        raise RuntimeError("page pool too small for a single sequence")
      self._preempt(max(running, key=lambda s: s.order), stats)
    for s in self._slots:
      if s is not None and want[id(s)] > 0:
        s.pages += self._pool.alloc(want[id(s)])

  def _preempt(self, seq: Seq, stats: RolloutStats) -> None:
    self._pool.release(seq.pages)
    seq.pages = []
    seq.preemptions += 1
    stats.preemptions += 1
    self._slots[self._slots.index(seq)] = None
    self._resume.append(seq)

  # ----------------------------------------------------------------------------------- decode
  @functools.partial(jax.profiler.annotate_function, name="grpo/rollout/decode")
  def _decode(self, stats: RolloutStats) -> None:
    t = time.perf_counter()
    table = np.full((len(self._slots), self.config.pages_per_seq), NULL_PAGE, np.int32)
    for i, s in enumerate(self._slots):
      if s is not None:
        table[i, : len(s.pages)] = s.pages
    cache = self._cache.with_table(jnp.asarray(table))
    toks, logps, emitted, self._cache = steps.decode_chunk(
      *self._graph, cache, self.config.steps_per_sync, **self._slot_arrays(self._slots)
    )
    toks, logps, emitted = jax.device_get((toks, logps, emitted))
    for i, s in enumerate(self._slots):
      if s is not None:
        self._accept(s, toks[emitted[:, i], i], logps[emitted[:, i], i])
    stats.decode_steps += self.config.steps_per_sync
    stats.decode_s += time.perf_counter() - t
    self._retire()

  def _retire(self) -> None:
    for i, s in enumerate(self._slots):
      if s is not None and s.finish is not None:
        self._pool.release(s.pages)
        s.pages = []
        self._slots[i] = None
