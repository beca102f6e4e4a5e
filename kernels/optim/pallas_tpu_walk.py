"""The body of the tiled multi-tensor kernel (:mod:`kernels.optim.pallas_tpu` launches it): the walk over
a :class:`kernels.optim.pallas_tpu_plan.Plan`'s work items, DMA by DMA.

Pipelined (Mosaic TPU, and the TPU interpreter given ``pltpu.InterpretParams``): the class buffers
are ``plan.slots`` deep; item k lives in slot k mod S. Iteration k waits for the stores of item
k + 1 - S (its slot is item k + 1's), starts item k + 1's loads, then waits for item k's loads,
updates it in VMEM and starts its stores: while item k is computed, item k + 1 streams in and items
k - 1 .. k + 2 - S stream out. k runs from lo - 1 (loads only) to hi + S - 2 (the last stores
drained), so each kind of DMA has one site in the program.

Synchronous (the plain CPU interpreter, ``interpret=True``): the same plan, segments, windows, class
buffers and strips, the copies as plain window loads and stores. Its DMA discharge rules copy at
``start`` anyway (an ordering bug cannot show there); the async pipeline is checked by the TPU
interpreter's on-wait DMAs (tests/kernels/optim/test_optim.py) and compiled by Mosaic, and the synchronous walk
compiles in half the interpreter's time (CI runs it in every parity test).

Item k's segment is found by a balanced tree of comparisons against the static segment starts, one
branch per segment issuing that leaf's DMAs (its refs and window shape are static there); waits
dispatch on the window kind (a wait needs its copy's shape, not its address); the math runs per
class on (sublanes, <= 512)-lane strips, only over the rows the item holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import backend
from kernels.optim import pallas_tpu_plan as tiles

STRIP_LANES = 512  # columns per compute strip: (8, 512) f32 is 4 vregs per array


def kernel(s_ref, *refs, plan: tiles.Plan, io, bodies, n_in: int, n_out: int, sync: bool):
  """refs: the leaves' inputs then outputs (HBM), each class's buffers (VMEM, [S, rows, cols]),
  then (pipelined) the input and output DMA semaphores ([S, arrays])."""
  ins, outs, rest = refs[:n_in], refs[n_in : n_in + n_out], refs[n_in + n_out :]
  bufs, k = [], 0
  for c in plan.classes:
    bufs.append(rest[k : k + len(c.buffers)])
    k += len(c.buffers)
  sems = (None, None) if sync else (rest[k], rest[k + 1])
  scalars = tuple(s_ref[i] for i in range(s_ref.shape[0]))
  walk = _Walk(plan, io, ins, outs, bufs, sems, sync)
  core = pl.program_id(0)
  lo = sum(jnp.where(core == c, plan.splits[c], 0) for c in range(len(plan.splits) - 1))
  hi = sum(jnp.where(core == c, plan.splits[c + 1], 0) for c in range(len(plan.splits) - 1))

  def update(k, slot, cls, rows):
    def run(c):
      _compute(plan.classes[c], bodies[c], bufs[c], slot, rows, scalars)

    _tree(cls, range(len(plan.classes)), run)

  if sync:

    def item(k, carry):
      _, cls, rows = walk.copy(k, "in")
      update(k, 0, cls, rows)
      walk.copy(k, "out")
      return carry

    jax.lax.fori_loop(lo, hi, item, 0)
    return
  _pipeline(walk, plan.slots, lo, hi, update)


def _pipeline(walk, S: int, lo, hi, update):
  none = (jnp.int32(-1), jnp.int32(-1), jnp.int32(0))  # (wait kind, class, rows) of no item
  live = lambda i: jnp.logical_and(lo <= i, i < hi)

  def step(k, ring):  # ring[i]: (wait kind, class, rows) of item k - i
    old = k + 1 - S
    _when(live(old), lambda: walk.wait(ring[S - 1][0], _mod(old, S), "out"))
    nxt = jax.lax.cond(live(k + 1), lambda: walk.copy(k + 1, "in"), lambda: none)

    def this():
      slot = _mod(k, S)
      kind, cls, rows = ring[0]
      walk.wait(kind, slot, "in")
      update(k, slot, cls, rows)
      walk.copy(k, "out")

    _when(live(k), this)
    return (nxt, *ring[:-1])

  jax.lax.fori_loop(lo - 1, hi + S - 1, step, (none,) * S)


def _mod(x, m: int):
  """x mod m for x >= 0 (lax.rem: jnp's % lowers through sign, which Mosaic resolves by asking the
  device, and a deviceless compile has none)."""
  return jax.lax.rem(x, jnp.int32(m))


def _when(pred, fn):
  jax.lax.cond(pred, lambda: (fn(), None)[1], lambda: None)


def _tree(index, keys: Sequence[int], fn):
  """``fn(key)`` for the key equal to ``index`` among the sorted ``keys`` (``index`` is one of them):
  a balanced tree of comparisons."""
  keys = list(keys)
  if len(keys) == 1:
    return fn(keys[0])
  mid = len(keys) // 2
  return jax.lax.cond(
    index < keys[mid], lambda: _tree(index, keys[:mid], fn), lambda: _tree(index, keys[mid:], fn)
  )


def _ranges(index, starts: Sequence[int], fn):
  """``fn(i)`` for the i with starts[i] <= index < starts[i + 1] (``index`` in range)."""

  def go(lo: int, hi: int):
    if hi - lo == 1:
      return fn(lo)
    mid = (lo + hi) // 2
    return jax.lax.cond(index < starts[mid], lambda: go(lo, mid), lambda: go(mid, hi))

  return go(0, len(starts))


class _Walk:
  """The copies of work items: ``copy(k, way)`` issues item k's loads ("in") or stores ("out") and
  returns its (wait kind, class, rows); ``wait(kind, slot, way)`` waits for one item's copies."""

  def __init__(self, plan: tiles.Plan, io, ins, outs, bufs, sems, sync: bool):
    self.plan, self.io, self.ins, self.outs, self.bufs = plan, io, ins, outs, bufs
    self.sems, self.sync = sems, sync
    self.kinds = plan.waits()
    self.starts = [s.start for s in plan.segments]
    # a wait names a real window of its kind (Mosaic checks its slice like the copy's)
    self.kind_seg = [next(s for s in plan.segments if (s.cls, s.window) == kd) for kd in self.kinds]

  def _pairs(self, seg: tiles.Segment, start, slot, way):
    """(src, dst, semaphore) of each array of one item: HBM window <-> VMEM buffer prefix."""
    in_base, n_ins, out_base, n_outs = self.io[seg.leaf]
    c = self.plan.classes[seg.cls]
    if way == "in":
      refs, which = self.ins[in_base : in_base + n_ins], c.in_buffer
    else:
      refs, which = self.outs[out_base : out_base + n_outs], c.out_buffer
    sem = self.sems[0 if way == "in" else 1]
    for a, (ref, b) in enumerate(zip(refs, which)):
      hbm, vmem = _hbm_window(ref, start, seg.window), _vmem_window(self.bufs[seg.cls][b], slot, seg.window)  # fmt: skip
      src, dst = (hbm, vmem) if way == "in" else (vmem, hbm)
      yield src, dst, None if sem is None else sem.at[slot, a]

  def copy(self, k, way: str):
    def seg_branch(i):
      seg = self.plan.segments[i]
      start = _window_start(seg, k - seg.start)
      slot = jnp.int32(0) if self.sync else _mod(k, self.plan.slots)
      for src, dst, sem in self._pairs(seg, start, slot, way):
        if self.sync:
          dst[...] = src[...]
        else:
          backend._tpu_module().make_async_copy(src, dst, sem).start()
      kind = self.kinds.index((seg.cls, seg.window))
      return jnp.int32(kind), jnp.int32(seg.cls), jnp.int32(seg.window[1])

    return _ranges(k, self.starts, seg_branch)

  def wait(self, kind, slot, way: str):
    def kind_branch(q):
      seg = self.kind_seg[q]
      for src, dst, sem in self._pairs(seg, seg.base, slot, way):
        backend._tpu_module().make_async_copy(src, dst, sem).wait()

    _tree(kind, range(len(self.kinds)), kind_branch)


def _window_start(seg: tiles.Segment, j):
  """The window start of item j of ``seg`` (j traced): a mixed-radix split over seg.counts."""
  idx = []
  for c in reversed(seg.counts):
    idx.append(_mod(j, c) if c > 1 else jnp.int32(0))
    j = jax.lax.div(j, jnp.int32(c)) if c > 1 else j
  idx.reverse()
  return tuple(b + i * t for b, i, t in zip(seg.base, idx, seg.step))


def _hbm_window(ref, start, window):
  """The leaf's (h, w) window of its (R, C) plane at l ([L, R, C]; [R, C] has no l)."""
  # Mosaic does not bounds-check a static slice size: a plan made for another view of the leaf
  # would read past its rows here
  assert window[1] <= ref.shape[-2] and window[2] <= ref.shape[-1], (window, ref.shape)
  plane = (pl.ds(start[1], window[1]), pl.ds(start[2], window[2]))
  return ref.at[(start[0], *plane)] if len(ref.shape) == 3 else ref.at[plane]


def _vmem_window(buf, slot, window):
  """The prefix of the class buffer's slot that holds a window (the tile may have more rows)."""
  return buf.at[slot, pl.ds(0, window[1]), pl.ds(0, window[2])]


def _compute(cls: tiles.TileClass, body, bufs, slot, rows, scalars):
  """``body`` over the item's rows of the class buffers at ``slot``: every input strip is loaded
  before any output is stored (outputs may overwrite input buffers)."""
  ins = [bufs[b] for b in cls.in_buffer]
  outs = [bufs[b] for b in cls.out_buffer]
  sub, cols = cls.sub, cls.tile[1]
  if cls.tile[0] % sub:  # a packed class of one ragged row count (see tiles): one strip of them all
    sub, rows = cls.tile[0], jnp.int32(cls.tile[0])

  def strip(i, carry):
    r = pl.multiple_of(i * sub, sub)
    for c0 in range(0, cols, STRIP_LANES):
      index = (slot, pl.ds(r, sub), pl.ds(c0, min(STRIP_LANES, cols - c0)))
      vals = [ref[index].astype(jnp.float32) for ref in ins]
      for ref, val in zip(outs, body(scalars, *vals)):
        ref[index] = val.astype(ref.dtype)
    return carry

  jax.lax.fori_loop(0, jax.lax.div(rows + (sub - 1), jnp.int32(sub)), strip, 0)
