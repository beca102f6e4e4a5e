"""The work plan of the tiled multi-tensor step (:mod:`kernels.optim.pallas_tpu`): which windows of which
leaves, in which order, through which VMEM buffers — plain Python on static shapes, no jax.

Every leaf is kept in its own layout: a TPU array [..., R, C] is stored in (8, 128) tiles of its last
two dims (rows of tiles, row-major), so rows [r, r + h) of the leaf itself are one contiguous DMA,
while any other 2-D view of it (a flat [n / 2048, 2048]) is a relayout copy in HBM. The kernel sees
each leaf as [L, R, C] (L: the leading dims, major and untiled; a matrix has none) and walks (h, w)
windows of its (R, C) plane: whole rows (w = C) while ``sub`` rows of them fit the window budget,
and as many rows as fit, a divisor of R where one is close (no ragged last window). A 1-D leaf [n]
is handed over as [n / 128, 128] (n a multiple of 128: the same bytes as its T(1024) layout, a
bitcast) or [1, n] (n <= 128: T(128) = T(1, 128), a bitcast; other n: a copy of a small vector).

Windows with the same width, dtypes and update body share a *class*: one set of VMEM buffers
(``slots`` deep, one per array) with the rows of its tallest window (a shorter window fills a
prefix). Widths key the classes because Mosaic slices a VMEM buffer only at whole (8, 128) tiles or
to its end. Each distinct window shape of a leaf is one *segment*: a run of consecutive work items
with one static DMA shape, so the kernel's item -> (leaf, window) map is a comparison tree over
segment starts and a mixed-radix split inside the segment (the 0.5B tree: 290 leaves, 290
segments, 3 classes).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Hashable, Sequence

import numpy as np

LANES = 128
MIN_TILE_ELEMS = 1024  # one (8, 128) f32 tile
MAX_TILE_ELEMS = 1 << 17  # 512 KiB of f32 per array per item: per-item overhead is then ~1 %


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One leaf as the plan sees it: its shape, the dtypes of its buffers (inputs then outputs), the
  input buffer each output reuses in VMEM (-1: its own), and its body's key (leaves with equal keys
  run the same body: one class)."""

  shape: tuple[int, ...]
  in_dtypes: tuple[np.dtype, ...]
  out_dtypes: tuple[np.dtype, ...]
  body_key: Hashable

  @property
  def view(self) -> tuple[int, ...]:
    """The kernel's view: [L, R, C] (L = product of the leading dims; [R, C] is [1, R, C])."""
    shape = (1,) * (2 - len(self.shape)) + tuple(self.shape)
    return (math.prod(shape[:-2]), shape[-2], shape[-1])

  @property
  def bytes_per_element(self) -> int:
    return sum(np.dtype(d).itemsize for d in self.in_dtypes + self.out_dtypes)


def sublanes(dtypes) -> int:
  """Rows of one VMEM tile for the narrowest dtype: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
  return 8 * max(4 // np.dtype(d).itemsize for d in dtypes)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class TileClass:
  """Windows sharing VMEM buffers: ``tile`` is (rows, cols); ``buffers`` the dtype
  of each buffer; ``in_buffer`` / ``out_buffer`` which buffer each input / output uses (an output
  reuses an input's buffer of its dtype: every strip loads all inputs before it stores)."""

  tile: tuple[int, ...]
  sub: int  # rows of one VMEM tile for this class's narrowest dtype
  buffers: tuple[np.dtype, ...]
  in_buffer: tuple[int, ...]
  out_buffer: tuple[int, ...]
  body_key: Hashable
  leader: int  # the first leaf of the class: its body runs for every member

  def vmem_bytes(self, slots: int) -> int:
    """The class's buffers with VMEM's (sub, 128) tile padding, ``slots`` deep."""
    rows, cols = round_up(self.tile[0], self.sub), round_up(self.tile[1], LANES)
    padded = [rows * cols * np.dtype(d).itemsize for d in self.buffers]
    return slots * sum(padded)


@dataclasses.dataclass(frozen=True)
class Segment:
  """Consecutive work items of one leaf with one window shape: items [start, start + count) are the
  windows of the [L, R, C] view at ``base`` + (i_l, i_r step_r, i_c step_c) over ``counts``
  (row-major), each of ``window`` = (1, h, w) elements."""

  leaf: int
  cls: int
  start: int
  counts: tuple[int, ...]
  base: tuple[int, ...]
  step: tuple[int, ...]
  window: tuple[int, ...]

  @property
  def count(self) -> int:
    return math.prod(self.counts)


@dataclasses.dataclass(frozen=True)
class Plan:
  classes: tuple[TileClass, ...]
  segments: tuple[Segment, ...]
  items: int
  splits: tuple[int, ...]  # core c walks items [splits[c], splits[c + 1])
  slots: int
  tile_elems: int

  def vmem_bytes(self) -> int:
    return sum(c.vmem_bytes(self.slots) for c in self.classes)

  def waits(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The distinct (class, window) pairs: a DMA wait needs its copy's exact shape."""
    return tuple(dict.fromkeys((s.cls, s.window) for s in self.segments))


def _leaf_tile(spec: LeafSpec, tile_elems: int, max_cols: int | None) -> tuple[int, int]:
  """The window of ``spec``'s (R, C) plane: whole rows while ``sub`` of them fit ``tile_elems``
  (else ``max_cols`` / the widest multiple of 128 that fits), and as many rows as fit — preferring a
  divisor of R (no ragged last window: one segment less) down to half of what fits."""
  _, rows, cols = spec.view
  sub = sublanes(spec.in_dtypes + spec.out_dtypes)
  width = max(LANES, (tile_elems // sub if max_cols is None else max_cols) // LANES * LANES)
  bc = cols if cols <= width else width
  fit = max(sub, tile_elems // round_up(bc, LANES) // sub * sub)
  if rows <= fit:
    return rows, bc
  for br in range(fit, max(sub, fit // 2) - 1, -sub):
    if rows % br == 0:
      return br, bc
  return fit, bc


def _buffers(spec: LeafSpec, out_reuses: Sequence[int]):
  """Buffers: one per input, plus one per output that reuses none (its dtype)."""
  buffers = list(spec.in_dtypes)
  out_buffer = []
  for o, reuse in enumerate(out_reuses):
    if reuse >= 0:
      out_buffer.append(reuse)
    else:
      out_buffer.append(len(buffers))
      buffers.append(spec.out_dtypes[o])
  return tuple(np.dtype(b) for b in buffers), tuple(range(len(spec.in_dtypes))), tuple(out_buffer)


def out_reuse(in_dtypes, out_dtypes) -> tuple[int, ...]:
  """For each output, an input buffer of its dtype it can overwrite (each input at most once), or -1.
  Greedy in order: outputs usually mirror their inputs (param / master, state slots)."""
  free = list(range(len(in_dtypes)))
  out = []
  for d in out_dtypes:
    pick = next((i for i in free if np.dtype(in_dtypes[i]) == np.dtype(d)), -1)
    if pick >= 0:
      free.remove(pick)
    out.append(pick)
  return tuple(out)


def _segments(leaf: int, view, tile, start: int) -> list[Segment]:
  """The leaf's windows grouped by shape: per tiled dim, the full windows then the ragged one (the
  class is filled in by the caller)."""
  dims = [(view[0], 1), (view[1], tile[0]), (view[2], tile[1])]
  per_dim = []
  for n, t in dims:
    runs = [(n // t, 0, t)] if n // t else []
    if n % t:
      runs.append((1, n // t * t, n % t))
    per_dim.append(runs)
  out = []
  for combo in itertools.product(*per_dim):
    counts = tuple(c for c, _, _ in combo)
    base = tuple(b for _, b, _ in combo)
    window = tuple(w for _, _, w in combo)
    step = tuple(t for _, t in dims)
    out.append(Segment(leaf, -1, start, counts, base, step, window))
    start += math.prod(counts)
  return out


def make_plan(
  specs: Sequence[LeafSpec],
  *,
  vmem_budget: int,
  cores: int = 1,
  slots: int = 3,
  tile_elems: int | None = None,
  max_cols: int | None = None,
) -> Plan:
  """The plan for ``specs`` (each of size > 0). ``tile_elems``: elements per array per window; None:
  the largest power of two <= MAX_TILE_ELEMS whose buffers fit ``vmem_budget`` bytes. ValueError
  when even the smallest tiles do not fit."""
  if tile_elems is not None:
    return _plan(specs, tile_elems, max_cols, slots, cores)
  elems = MAX_TILE_ELEMS
  while True:
    plan = _plan(specs, elems, max_cols, slots, cores)
    if plan.vmem_bytes() <= vmem_budget:
      return plan
    if elems <= MIN_TILE_ELEMS:
      raise ValueError(
        f"the optimizer's VMEM buffers need {plan.vmem_bytes()} bytes at the smallest tiles "
        f"({len(plan.classes)} classes x {slots} slots), over the budget of {vmem_budget}"
      )
    elems //= 2


def _plan(specs, tile_elems: int, max_cols, slots: int, cores: int) -> Plan:
  # classes are keyed by window width, not by leaf: Mosaic slices a VMEM buffer's lanes only at
  # whole (8, 128) tiles or to its end, so a ragged last column window (C % 128 != 0) gets buffers
  # of its own width, and a buffer is never narrower or wider than a window's unaligned width
  # ... and a buffer's rows only at whole sublane tiles too (8 rows for 32-bit, 16 for packed 16-bit
  # dtypes; compiled: a [28, 1536] f32 window of a [64, 1536] buffer is "Slice sizes along tiled
  # dimensions must be aligned to tiles"): a window with a ragged row count gets buffers of exactly
  # its rows
  keys, rows, segments, start = {}, [], [], 0
  for i, spec in enumerate(specs):
    sub = sublanes(spec.in_dtypes + spec.out_dtypes)
    for seg in _segments(i, spec.view, _leaf_tile(spec, tile_elems, max_cols), start):
      h, w = seg.window[1:]
      exact = h if h % sub else None
      key = (w, exact, spec.in_dtypes, spec.out_dtypes, spec.body_key)
      if key not in keys:
        keys[key] = (len(rows), i)
        rows.append(0)
      cls = keys[key][0]
      rows[cls] = max(rows[cls], h)
      segments.append(dataclasses.replace(seg, cls=cls))
      start += seg.count
  classes = []
  for (width, exact, *_), (cls, lead) in keys.items():
    spec = specs[lead]
    sub = sublanes(spec.in_dtypes + spec.out_dtypes)
    buffers, in_buf, out_buf = _buffers(spec, out_reuse(spec.in_dtypes, spec.out_dtypes))
    tile = (exact or round_up(rows[cls], sub), width)
    classes.append(TileClass(tile, sub, buffers, in_buf, out_buf, spec.body_key, lead))
  splits = _splits(specs, segments, start, cores)
  return Plan(tuple(classes), tuple(segments), start, splits, slots, tile_elems)


def _splits(specs, segments, items: int, cores: int) -> tuple[int, ...]:
  """Item boundaries giving each core about the same bytes (megacore parts: 2 TensorCores)."""
  weights = []
  for s in segments:
    weights += [math.prod(s.window) * specs[s.leaf].bytes_per_element] * s.count
  cum = np.cumsum([0] + weights)
  total = cum[-1]
  cuts = [int(np.searchsorted(cum, total * c / cores)) for c in range(1, cores)]
  return (0, *cuts, items)


def item_window(seg: Segment, j: int) -> tuple[int, ...]:
  """The window start of item ``j`` (0-based within ``seg``), for tests and the reference walk."""
  idx = []
  for c in reversed(seg.counts):
    idx.append(j % c)
    j //= c
  idx.reverse()
  return tuple(b + i * t for b, i, t in zip(seg.base, idx, seg.step))
