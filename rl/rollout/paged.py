"""The paged engine: continuous batching over a fixed number of decode slots on the paged KV cache.

Each scheduling round: (1) admit work into free slots — preempted sequences first, then new requests,
a request's whole group at once — and prefill it in one batched call (a group's samples share the
prompt's full pages and copy only its partial last page); sequences that finish on their first token
(max_new_tokens=1, a first-token EOS, a prompt one token short of max_seq_len) retire right there and
the round admits again; (2) give every running sequence the pages its next `steps_per_sync` tokens
need, preempting the newest sequences when the pool runs dry (they are recomputed later from their
tokens: nothing is lost or cut); (3) run one decode chunk; (4) retire finished sequences, freeing their
slots and pages for the next round.

One `generate` call's scheduler state (slots, queues, page pool, device cache) lives in a `_Generation`
of its own; the engine keeps only its configuration and a spare KV cache between calls, so a call never
touches an earlier call's result, and a call that starts while another holds the cache gets its own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl.rollout import steps
from rl.rollout.engine import MIN_DECODE_ROWS, RolloutEngine, Seq, bucket
from rl.rollout.paged_cache import NULL_PAGE, PagedKVCache, PagePool, invariant_refusal
from rl.rollout.types import RolloutResult, RolloutStats, SamplingParams


class PagedEngine(RolloutEngine):
  def __init__(self, model, config, tokenizer=None, eos_ids=None):
    super().__init__(model, config, tokenizer, eos_ids)
    refusal = invariant_refusal(config.attn_impl) if model.cfg.batch_invariant else None
    if refusal:
      raise ValueError(refusal)
    self._spare_cache: PagedKVCache | None = self._new_cache()
    self._spare_lock = threading.Lock()  # check-out / return of the spare cache across threads

  def _new_cache(self) -> PagedKVCache:
    cfg, ecfg = self.model.cfg, self.config
    return PagedKVCache.create(
      cfg.num_layers,
      ecfg.pool_pages,
      ecfg.page_size,
      cfg.num_kv_heads,
      cfg.dim_per_head,
      self.cache_dtype,
      ecfg.attn_impl,
      self._kv_sharding(rank=4, heads_axis=0),
      self._kernel_sharding(),
    )

  def generate(
    self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
  ) -> RolloutResult:
    t0 = time.perf_counter()
    groups = self._requests(prompts, params)
    for g in groups:  # before any compile: a group the pool can never hold would stall the run
      self.config.check_group(len(g), len(g[0].prompt), what=f"prompt {g[0].prompt_index}")
    # Take the spare cache (its buffers are donated step by step); a concurrent call finds none and
    # makes its own. An interrupted call's cache is dropped, never left half-donated on the engine.
    with self._spare_lock:
      cache, self._spare_cache = self._spare_cache, None
    with self._precision():
      gen = _Generation(self, groups, cache if cache is not None else self._new_cache())
      gen.run()
    with self._spare_lock:
      self._spare_cache = gen.cache
    return self._result(groups, gen.stats, t0)


@dataclasses.dataclass
class _Admission:
  """One round's admitted work, prefilled together."""

  rows: list[tuple[Seq, list[int]]] = dataclasses.field(default_factory=list)  # (seq, its tokens)
  copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) pages
  fresh: list[Seq] = dataclasses.field(default_factory=list)  # new samples: draw a first token
  fresh_rows: list[int] = dataclasses.field(default_factory=list)  # the prefill row of their prompt


class _Generation:
  """The scheduler state of one `generate` call."""

  def __init__(self, engine: PagedEngine, groups: list[list[Seq]], cache: PagedKVCache):
    self.engine, self.config = engine, engine.config
    self.graph = engine._rollout_graph()  # the live parameters, in the compute dtype
    self.cache = cache
    self.pool = PagePool(self.config.pool_pages, self.config.page_size)
    self.slots: list[Seq | None] = [None] * self.config.max_slots
    self.waiting = collections.deque(groups)
    self.resume: collections.deque[Seq] = collections.deque()
    self.admissions = 0  # admission counter: preemption picks the newest
    self.stats = RolloutStats()

  @property
  def running(self) -> list[Seq]:
    return [s for s in self.slots if s is not None]

  def run(self) -> None:
    while self.waiting or self.resume or self.running:
      admitted = self.admit()
      if not self.running:
        if admitted:  # all of it finished at prefill: admit the next work
          continue
        raise RuntimeError(  # unreachable: generate checks every group against the pool
          f"nothing could be admitted into an idle engine ({self.pool.free} of "
          f"{self.pool.usable} pages free)"
        )
      self.reserve()
      self.decode()

  # ----------------------------------------------------------------------------------- admission
  def room(self, need: int, running: int, joining: int) -> bool:
    """Whether `need` pages can be taken now while keeping a chunk's pages free for the
    `running + joining` sequences that would then run, so admission does not force an immediate
    preemption; nothing is kept back when nothing runs (the first work must always get in)."""
    chunk = self.pool.pages_for(self.config.steps_per_sync)
    keep = 0 if running == 0 else (running + joining) * chunk
    return self.pool.free >= need + keep

  def admit(self) -> int:
    """Fill free slots (preempted sequences first, then whole groups) and prefill them; returns the
    number of sequences admitted."""
    free_slots = [i for i, s in enumerate(self.slots) if s is None]
    running = before = len(self.slots) - len(free_slots)
    batch = _Admission()
    while self.resume and free_slots:
      seq = self.resume[0]
      need = self.pool.pages_for(seq.cached)
      if not self.room(need, running, 1):
        break
      self.resume.popleft()
      seq.pages = self.pool.alloc(need)
      self.place(seq, free_slots.pop(0))
      batch.rows.append((seq, seq.prompt + seq.gen[:-1]))
      running += 1
    while self.waiting and not self.resume and len(free_slots) >= len(self.waiting[0]):
      group = self.waiting[0]
      need = self.pool.group_pages(len(group[0].prompt), len(group))
      if not self.room(need, running, len(group)):
        break
      self.waiting.popleft()
      tables, copies = self.pool.alloc_group(len(group[0].prompt), len(group))
      for seq, pages in zip(group, tables):
        seq.pages = pages
        self.place(seq, free_slots.pop(0))
      batch.copies += copies
      batch.fresh += group
      batch.fresh_rows += [len(batch.rows)] * len(group)
      batch.rows.append((group[0], group[0].prompt))  # its pages receive the prompt
      running += len(group)
    if batch.rows:
      self.prefill(batch)
    return running - before

  def place(self, seq: Seq, slot: int) -> None:
    self.slots[slot] = seq
    seq.admitted = seq.admitted or time.perf_counter()
    seq.order, self.admissions = self.admissions, self.admissions + 1

  @functools.partial(jax.profiler.annotate_function, name="grpo/rollout/prefill")
  def prefill(self, batch: _Admission) -> None:
    t = time.perf_counter()
    ecfg = self.config
    width = min(
      bucket(max(len(toks) for _, toks in batch.rows)), ecfg.pages_per_seq * ecfg.page_size
    )
    n = bucket(len(batch.rows), minimum=1)
    tokens = np.zeros((n, width), np.int32)
    last = np.zeros(n, np.int32)
    table = np.full((n, ecfg.pages_per_seq), NULL_PAGE, np.int32)
    for i, (seq, toks) in enumerate(batch.rows):
      tokens[i, : len(toks)] = toks
      last[i] = len(toks) - 1
      table[i, : len(seq.pages)] = seq.pages
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (n, width))
    cache = self.cache.with_table(jnp.asarray(table))
    logits, cache = steps.prefill(
      *self.graph, cache, jnp.asarray(tokens), positions, jnp.asarray(last)
    )
    if batch.copies:
      src, dst = zip(*batch.copies)
      cache = steps.copy_pages(cache, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    self.cache = cache
    if batch.fresh:  # each sample of a new group draws its first token from its prompt's logits
      rows = jnp.asarray(batch.fresh_rows, jnp.int32)
      first, lps, gaps = jax.device_get(
        steps.sample_first(
          logits[rows],
          *self.engine._sampling_arrays(batch.fresh),
          self.engine._filtered(batch.fresh),
        )
      )
      for i, s in enumerate(batch.fresh):
        self.engine._accept(s, first[i : i + 1], lps[i : i + 1], gaps[i : i + 1])
    else:
      jax.block_until_ready(cache.k)
    self.stats.prefill_s += time.perf_counter() - t
    self.stats.prefill_tokens += sum(len(toks) for _, toks in batch.rows)
    self.retire()

  # ----------------------------------------------------------------------------------- pages
  def chunk_end(self, seq: Seq) -> int:
    """Tokens `seq` will have cached after the next chunk (never past its last input token)."""
    return min(seq.cached + self.config.steps_per_sync, len(seq.prompt) + seq.limit - 1)

  def reserve(self) -> None:
    """Pages for every running sequence's next chunk; preempt the newest until they fit."""
    while True:
      running = self.running
      short = sum(self.pool.missing(s.pages, self.chunk_end(s)) for s in running) - self.pool.free
      if short <= 0:
        break
      if len(running) == 1:  # unreachable with a valid config: one sequence always fits
        raise RuntimeError("page pool too small for a single sequence")
      self.preempt(max(running, key=lambda s: s.order))
    for s in running:
      s.pages = self.pool.grow(s.pages, self.chunk_end(s))

  def preempt(self, seq: Seq) -> None:
    self.pool.release(seq.pages)
    seq.pages = []
    seq.preemptions += 1
    self.stats.preemptions += 1
    self.slots[self.slots.index(seq)] = None
    self.resume.append(seq)

  # ----------------------------------------------------------------------------------- decode
  @functools.partial(jax.profiler.annotate_function, name="grpo/rollout/decode")
  def decode(self) -> None:
    """One chunk over the running sequences only, packed into the first rows of a batch of
    `decode_rows` (a power of two, at most max_slots): when requests finish and nothing waits, the
    chunk shrinks with the work (a static batch keeps decoding its finished rows), and each size is
    one compile. A sequence's row does not matter: its tokens, positions, keys and pages are inputs.
    The page table is as wide as the longest running sequence needs (`decode_width`), so attention
    over the gathered pages (the XLA path) reads the live context, not max_seq_len."""
    t = time.perf_counter()
    ecfg = self.config
    running = self.running
    rows: list[Seq | None] = running + [None] * (
      decode_rows(len(running), ecfg.max_slots) - len(running)
    )
    width = decode_width(max(len(s.pages) for s in running), ecfg.pages_per_seq)
    table = np.full((len(rows), width), NULL_PAGE, np.int32)
    for i, s in enumerate(running):
      table[i, : len(s.pages)] = s.pages
    cache = self.cache.with_table(self.engine._put_rows(jnp.asarray(table)))
    toks, logps, gaps, emitted, self.cache = steps.decode_chunk(
      *self.graph,
      cache,
      ecfg.steps_per_sync,
      self.engine._filtered(rows),
      **self.engine._slot_arrays(rows),
    )
    toks, logps, gaps, emitted = jax.device_get((toks, logps, gaps, emitted))
    for i, s in enumerate(running):
      self.engine._accept(s, *(x[emitted[:, i], i] for x in (toks, logps, gaps)))
    self.stats.decode_steps += ecfg.steps_per_sync
    self.stats.decode_s += time.perf_counter() - t
    self.retire()

  def retire(self) -> None:
    for i, s in enumerate(self.slots):
      if s is not None and s.finish is not None:
        self.pool.release(s.pages)
        s.pages = []
        self.slots[i] = None


def decode_rows(running: int, max_slots: int) -> int:
  """Rows of a decode chunk for `running` sequences: the next power of two (>= 8), at most max_slots
  (bounded compiles: log2(max_slots) sizes at most)."""
  return min(bucket(running, minimum=MIN_DECODE_ROWS), max_slots)


def decode_width(pages: int, pages_per_seq: int) -> int:
  """Page-table width of a decode chunk whose longest sequence holds `pages` pages (its pages for the
  whole chunk): the next power of two (>= 16 pages), at most pages_per_seq."""
  return min(bucket(pages, minimum=16), pages_per_seq)
