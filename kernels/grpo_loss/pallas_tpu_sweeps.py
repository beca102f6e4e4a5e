"""Register-sized sweeps of the tiled (TPU) loss kernels: row groups x 128-lane slabs, lane partials.

Why: a whole [bn, bv] tile as one value makes Mosaic hold the tile and its temporaries in registers it
does not have (64 vector registers of [8, 128] f32): at 128 x 2048 libtpu's schedule spent 1397 of
the forward's 1621 vector loads per grid step on spill reloads (bench/tpu/schedule.py reads it).

Here a kernel holds [rows, V] row blocks in VMEM and sweeps each group of ``G`` rows (16 packed
2-byte rows, 8 f32 rows: one vreg's worth) in 128-lane slabs:

1. the lanes' max ([G, 128], in the logits' own dtype where the chip has a bf16 VPU);
2. the exponentials relative to it, folded by :func:`kernels.lse.online_step` with ``rmax=None`` (the
   max is known: no rescaling), the slab axis as its reduction (elementwise across registers);
3. one merge of a row's 128 lanes (:func:`kernels.lse.merge`) when the row is done.

Taking the max first costs one cheap sweep but frees the exponentials from waiting on it: in the
one-sweep online form every loop step's exponentials queue behind that step's max and the EUP's
latency (libtpu's schedule: ~4 bundles per vreg); here the unrolled steps are independent and the
static schedule fills the four vector ALU slots (~2.2 bundles per vreg, the VALU bound at 8 ops per
element). The chosen token's logit is one gather outside the kernel
(:func:`kernels.lse.chosen_logit`): the sweeps never compare columns with the id.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import lse, support

LANES = 128
SLABS_PER_FOLD = 4  # slabs one online step folds: 4 x [16, 128] f32 = 8 vregs of logits
MAX_SLABS = 16  # slabs one step of the max sweep reduces (bf16: 16 half-empty vregs)


@dataclasses.dataclass(frozen=True)
class Sweep:
  """How the columns [0, width) of a row block are swept (all static)."""

  width: int  # columns of the block (the whole vocabulary)
  lanes: int  # slab width: 128, or width when narrower
  inv_t: float  # 1 / temperature
  per_fold: int = SLABS_PER_FOLD  # slabs one online step folds
  unroll: int = 8  # online steps per loop iteration (LossBlocks.block_v / (per_fold x lanes))
  # the interpreter's form (:func:`sweep_of`): one slab as wide as the row, and each row's chosen
  # column read / written by one whole-group select instead of a window per row
  whole_rows: bool = False
  # no bf16 VPU (v4): windows converted to f32 before splitting, the max in f32 (:func:`load_window`)
  unpack: bool = False

  @property
  def full(self) -> int:
    return self.width // self.lanes

  @property
  def tail(self) -> int:
    return self.width - self.full * self.lanes


# The gapped sweeps' loop bodies are this many times longer (columns per iteration): the gap's
# compare and select per element fill the VLIW slots better over a longer body. libtpu's schedule of
# qwen2.5-8k on v6e (12 -> 24 folds): the gapped forward 13387 -> 13025 bundles a grid step
# (ungapped 12109), the training kernel 12140 -> 11660 (ungapped 10782); CHANGELOG has the ratios.
GAPPED_UNROLL = 2


def sweep_of(
  width: int,
  temperature: float,
  block_v: int = 4096,
  interpret: bool = False,
  gapped=False,
  unpack=False,
) -> Sweep:
  """The sweep of [rows, width] blocks: ``block_v`` columns per loop iteration (whole folds of
  SLABS_PER_FOLD slabs, unrolled: independent steps the scheduler interleaves); ``gapped`` (a
  support gap in the sweeps): :data:`GAPPED_UNROLL` times as many.

  ``interpret`` (the Pallas interpreter: a CPU target): one slab as wide as the row, no loop. The
  slabs and their unrolling are the TPU scheduler's need; the interpreter executes every written-out
  step one by one (a 16-row group at V = 32000 is 250 slabs: the cpu-medium training call took
  ~42 s per call swept in slabs, ~2 s as whole rows on 2 cores). The TPU-interpreter tests
  (tests/kernels/test_tpu_interpret.py) run the slab form. ``unpack``: :attr:`Sweep.unpack`."""
  if interpret:
    return Sweep(width, width, 1.0 / temperature, 1, 1, whole_rows=True)
  lanes = min(LANES, width)
  per_fold = min(SLABS_PER_FOLD, max(1, width // lanes))
  unroll = max(1, block_v // (per_fold * lanes)) * (GAPPED_UNROLL if gapped else 1)
  return Sweep(width, lanes, 1.0 / temperature, per_fold, unroll, unpack=unpack)


def row_group(block_n: int, dtype) -> int:
  """Rows per group: one vreg's worth (16 packed 2-byte rows, 8 f32 rows), at most the block."""
  return min(block_n, 16 if jnp.dtype(dtype).itemsize <= 2 else 8)


def for_row_groups(block_n: int, group: int, body) -> None:
  """body(rows: pl.ds, size: int) over the block's rows: full groups in a loop, the rest static."""
  full, rest = divmod(block_n, group)
  if full == 1:
    body(pl.ds(0, group), group)
  elif full > 1:

    @pl.loop(0, full)
    def _(g):
      body(pl.ds(pl.multiple_of(g * group, group), group), group)

  if rest:
    body(pl.ds(full * group, rest), rest)


def tree(op, a):
  """op-reduce a stack [k, ...] over its leading axis pairwise: independent ops, not one chain."""
  while a.shape[0] > 1:
    h = a.shape[0] // 2
    top = op(a[:h], a[h : 2 * h])
    a = jnp.concatenate([top, a[2 * h :]]) if a.shape[0] % 2 else top
  return a[0]


def load_z(x_ref, rows, start, sw: Sweep, floor=None):
  """Scaled f32 logits of one [rows, lanes] slab at column ``start``; columns below ``floor``
  (static: already swept, when the tail window overlaps the slabs before it) -inf."""
  x = x_ref[rows, pl.ds(start, sw.lanes)].astype(jnp.float32)
  z = x if sw.inv_t == 1.0 else x * sw.inv_t
  if floor is None:
    return z
  col = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
  return jnp.where(col >= floor - start, z, -jnp.inf)


def load_window(x_ref, rows, first, count, sw: Sweep):
  """[count, G, lanes] logits in their own dtype from column ``first``: one wide load (one base
  address, immediate offsets: separate slab loads each cost a chain of scalar address arithmetic),
  split into slabs in registers. ``sw.unpack``: converted to f32 first, one native unpack a vreg
  (v4 has no bf16 VPU: a stack of bf16 slabs costs it four sublane rotations a vreg more)."""
  x = x_ref[rows, pl.ds(first, count * sw.lanes)]
  x = x.astype(jnp.float32) if sw.unpack else x
  return jnp.stack([x[:, i * sw.lanes : (i + 1) * sw.lanes] for i in range(count)])


def scale_z(raw, sw: Sweep):
  z = raw.astype(jnp.float32)
  return z if sw.inv_t == 1.0 else z * sw.inv_t


def unrolled_loop(steps: int, unroll: int, body, carry):
  """carry = body(c, carry) for c in [0, steps): a loop whose body is ``unroll`` steps written out
  (over the largest multiple of it), then the rest as straight-line steps.

  Unrolled here, not by fori_loop's ``unroll=``: jax 0.11's Pallas TPU lowering drops that argument
  (one step a trip: the qwen2.5-8k forward kernel's schedule grew from 12407 to 27017 bundles a grid
  step under libtpu 0.0.48.1, tests/bench/tpu/test_schedule.py), and fori_loop's own remainder loop (2 or
  more steps left over) segfaults libtpu 0.0.48.1's compiler on the training kernel (V = 128256: 250
  steps, unroll 8); 0.0.42.1 compiles both."""
  u = max(1, min(unroll, steps))
  trips = steps // u

  def group(i, carry):  # steps i*u .. i*u + u - 1
    for j in range(u):
      carry = body(i * u + j, carry)
    return carry

  if trips:
    carry = jax.lax.fori_loop(0, trips, group, carry)
  for c in range(trips * u, steps):
    carry = body(jnp.int32(c), carry)
  return carry


def sweep_slabs(x_ref, rows, sw: Sweep, each, carry, per_step: int, unroll: int, raw=False):
  """carry = each(z [k, G, lanes], carry) over the row's slabs: ``per_step`` slabs per step in a loop
  (unrolled ``unroll`` times), then the remaining slabs, then the tail narrower than a slab as the
  block's last ``lanes`` columns with the columns already swept masked (width >= lanes). ``raw``:
  full steps get the logits unscaled in their own dtype (the tail is always f32, scaled)."""
  k = max(1, min(per_step, sw.full))
  steps, rest = divmod(sw.full, k)

  def full(first, count):
    z = load_window(x_ref, rows, first, count, sw)
    return z if raw else scale_z(z, sw)

  if steps > 1:
    step = lambda c, cr: each(full(pl.multiple_of(c * (k * sw.lanes), sw.lanes), k), cr)
    carry = unrolled_loop(steps, unroll, step, carry)
  elif steps:
    carry = each(full(0, k), carry)
  if rest:
    z = load_window(x_ref, rows, steps * k * sw.lanes, rest, sw)
    carry = each(z if raw else scale_z(z, sw), carry)
  if sw.tail:
    z = load_z(x_ref, rows, sw.width - sw.lanes, sw, floor=sw.full * sw.lanes)[None]
    carry = each(z, carry, scaled=True) if raw else each(z, carry)
  return carry


def lane_max(x_ref, rows, sw: Sweep, size: int):
  """[size, lanes] f32: each lane's max of the scaled logits. Full steps reduce in the logits' own
  dtype (bf16 on a chip with a bf16 VPU: no unpack; the max of bf16 values is one of them, and
  scaling by 1 / T > 0 keeps the order; in f32 with ``sw.unpack``), scaled once at the end."""
  low = jnp.full((size, sw.lanes), -jnp.inf, jnp.float32 if sw.unpack else x_ref.dtype)
  top = jnp.full((size, sw.lanes), lse.NEG_BIG, jnp.float32)

  def each(z, carry, scaled=False):
    lo, hi = carry
    if scaled:  # the f32 tail, already scaled
      return lo, jnp.maximum(hi, tree(jnp.maximum, z))
    return jnp.maximum(lo, tree(jnp.maximum, z)), hi

  low, top = sweep_slabs(x_ref, rows, sw, each, (low, top), MAX_SLABS, 4 * sw.unroll, raw=True)
  return jnp.maximum(top, scale_z(low, sw))


def lane_stats(x_ref, rows, sw: Sweep, size: int, thr=None):
  """(m, l, s) lane partials [size, lanes] of a row group: the max sweep, then the exponentials'
  sweep folded by the shared online step with the max known (``rmax=None``). thr: [size, 1] the
  rows' support thresholds (:func:`kernels.support.gapped` on the exponentials' slabs: columns
  outside S give p = 0), or None. The max sweep is not gapped: a row's max is >= z_y >= its
  threshold, so it is the max over S too (a lane's may lie outside S: its terms are then 0)."""
  m = lane_max(x_ref, rows, sw, size)
  return (m, *lane_sums(x_ref, rows, sw, size, m, thr))


def lane_sums(x_ref, rows, sw: Sweep, size: int, m, thr=None):
  """(l, s) lane partials [size, lanes] of the exponentials' sweep against ``m`` ([size, lanes] lane
  maxima, or [size, 1]: any reference whose exp(z - m) does not overflow), the shared online step
  with nothing rescaled (``rmax=None``); thr as in :func:`lane_stats`."""
  rsum = lambda a: tree(jnp.add, a)
  if thr is not None:  # loop-invariant, over the lanes once
    thr = support.sweep_threshold(jnp.broadcast_to(thr, (size, sw.lanes)), m)

  def each(z, ls):
    if thr is None:
      _, l, s, _ = lse.online_step(z, None, m, *ls, rmax=None, rsum=rsum, expand=lambda a: a[None])
      return l, s
    # the gapped step: z - m over S, LOG_FLOOR outside (no clamp needed: one op more, not two)
    d = support.gapped_shift(z - m[None], thr[None])
    p = jnp.exp(d)
    return ls[0] + rsum(p), ls[1] + rsum(p * d)

  zeros = jnp.zeros((size, sw.lanes), jnp.float32)
  return sweep_slabs(x_ref, rows, sw, each, (zeros, zeros), sw.per_fold, sw.unroll)


def row_stats(x_ref, rows, size: int, sw: Sweep, chosen, thr=None):
  """(logp, entropy, lse_rel, shift), [size, 1] each, of ``rows`` of a [rows, V] block; chosen:
  [size, 1] (NaN where the id is outside [0, V): :func:`kernels.lse.chosen_logit`); thr: [size, 1]
  support thresholds or None (:func:`lane_stats`)."""
  m, l, s = lse.merge(*lane_stats(x_ref, rows, sw, size, thr), axis=1)
  return lse.finalize(m, l, s, chosen, 1.0)


def write_grads(x_ref, dx_ref, rows, sw: Sweep, m, l, g, thr=None):
  """dx = -g * softmax(z) over a row group's columns, in dx's dtype: the chosen column's + g is
  written afterwards (:func:`patch_chosen`), so the sweep never compares columns with the id.

  m, l: [G, 1] the rows' merged max and sum exp(z - m); g: [G, 1] d loss / d z_chosen; softmax =
  exp(z - m) / l with -g / l folded per row. g == 0 (a masked row) writes exactly 0 even where its
  logits are NaN / inf. Folds of per_fold slabs, unrolled; a tail narrower than a slab as it is.
  thr: [G, 1] support thresholds (softmax 0 outside S) or None.
  """
  nga = -g / l
  if thr is not None:  # a masked row (g == 0): an empty S (NaN) and a 0 factor, so exact zeros
    nga = jnp.where(g == 0, 0.0, nga)
    thr = jnp.where(g == 0, jnp.nan, support.sweep_threshold(thr, m))

  def block(first, z):  # z: [count, G, width] scaled logits of the columns from ``first``
    if thr is None:
      d = jnp.where(g[None] == 0, 0.0, nga[None] * jnp.exp(z - m[None]))
    else:  # the g == 0 select folded into the gap's (one op more than without a gap, not two)
      d = nga[None] * jnp.exp(support.gapped_shift(z - m[None], thr[None]))
    out = jnp.concatenate(list(d), axis=1) if d.shape[0] > 1 else d[0]
    dx_ref[rows, pl.ds(first, out.shape[1])] = out.astype(dx_ref.dtype)

  sweep_blocks(x_ref, rows, sw, block)


def sweep_blocks(x_ref, rows, sw: Sweep, block) -> None:
  """block(first, z) over a row group's columns, z [count, G, width] the scaled logits from column
  ``first``: folds of per_fold slabs in the unrolled loop, the remaining slabs, then a tail
  narrower than a slab as it is (the gradient sweeps, which store each block as it is done)."""
  k = max(1, min(sw.per_fold, sw.full))
  steps, rest = divmod(sw.full, k)

  def step(c, carry):
    first = pl.multiple_of(c * (k * sw.lanes), sw.lanes)
    block(first, scale_z(load_window(x_ref, rows, first, k, sw), sw))
    return carry

  if steps:
    unrolled_loop(steps, sw.unroll, step, 0)
  if rest:
    first = steps * k * sw.lanes
    block(first, scale_z(load_window(x_ref, rows, first, rest, sw), sw))
  if sw.tail:
    first = sw.full * sw.lanes
    block(first, scale_z(x_ref[rows, pl.ds(first, sw.tail)][None], sw))


def _group_ids(ids_ref, first_row, size: int, sw: Sweep):
  """([size, 1] ids, [size, 1] whether each is in [0, V)) of a row group, from SMEM one scalar a
  row (rows past N read the last id): the whole-row form's gather and patch select with them."""
  last = ids_ref.shape[0] - 1
  cols = jnp.stack([ids_ref[jnp.minimum(first_row + r, last)] for r in range(size)])[:, None]
  return cols, (cols >= 0) & (cols < sw.width)


def _aligned_start(c, sw: Sweep):
  """The lane-aligned start of the [size, lanes] slab holding column c (clipped into the whole
  slabs: a tail column's is the last slab's, which the caller does not use)."""
  cc = jnp.clip(c, 0, sw.full * sw.lanes - 1)
  if sw.lanes & (sw.lanes - 1) == 0:  # a power of two (128): one AND, no scalar division
    return pl.multiple_of(cc & -sw.lanes, sw.lanes)
  # cc >= 0: lax.rem is the floor remainder (jnp's // would need a sign op)
  return pl.multiple_of(cc - jax.lax.rem(cc, sw.lanes), sw.lanes)


def _row_windows(ids_ref, first_row, size: int, sw: Sweep, visit) -> None:
  """visit(r, c, start, ok) for each row r of a group: its id c (SMEM), the lane-aligned start of
  the [size, lanes] window holding column c (the block's last window for an id in a tail narrower
  than a slab) and whether c is in [0, V). Rows past N (a partial last block) read the last id."""
  last = ids_ref.shape[0] - 1
  aligned = sw.full * sw.lanes  # ids below it lie in a whole slab; the rest in the last window
  for r in range(size):
    c = ids_ref[jnp.minimum(first_row + r, last)]
    ok = (c >= 0) & (c < sw.width)
    if aligned:
      start = _aligned_start(c, sw)
      if sw.tail:
        pl.when(c < aligned)(lambda r=r, c=c, s=start, ok=ok: visit(r, c, s, ok))
      else:
        visit(r, c, start, ok)
    if sw.tail:
      pl.when(c >= aligned)(lambda r=r, c=c, ok=ok: visit(r, c, sw.width - sw.lanes, ok))


def gather_chosen(x_ref, rows, size: int, first_row, ids_ref, sw: Sweep):
  """[size, 1] f32: each row's scaled logit at its id, NaN for an id outside [0, V) (it poisons,
  never hides). Per row: the [size, lanes] window holding the id with all but its one element
  zeroed (NaN in lane 0 when the id is out of range); the rows' windows summed pairwise (independent
  rows, no chain) and across lanes once: every other element is 0, so the sum is the element."""
  if sw.whole_rows:
    cols, ok = _group_ids(ids_ref, first_row, size, sw)
    x = x_ref[rows, :].astype(jnp.float32)
    chosen = jnp.sum(jnp.where(cols == jax.lax.broadcasted_iota(jnp.int32, x.shape, 1), x, 0.0),
                     axis=1, keepdims=True)  # fmt: skip
    chosen = jnp.where(ok, chosen, jnp.nan)
    return chosen if sw.inv_t == 1.0 else chosen * sw.inv_t
  row = jax.lax.broadcasted_iota(jnp.int32, (size, sw.lanes), 0)
  lane = jax.lax.broadcasted_iota(jnp.int32, (size, sw.lanes), 1)
  picked = []
  last = ids_ref.shape[0] - 1
  aligned = sw.full * sw.lanes  # ids below it lie in a whole slab, the rest in the tail window
  # the block's last window (a static start: Mosaic proves no alignment of a dynamic unaligned one)
  tail = x_ref[rows, pl.ds(sw.width - sw.lanes, sw.lanes)].astype(jnp.float32) if sw.tail else None
  for r in range(size):
    c = ids_ref[jnp.minimum(first_row + r, last)]
    ok = (c >= 0) & (c < sw.width)
    start = _aligned_start(c, sw)
    w = x_ref[rows, pl.ds(start, sw.lanes)].astype(jnp.float32)
    kept = jnp.where((row == r) & (lane == c - start) & (c < aligned), w, 0.0)
    if sw.tail:  # both windows read, the one holding c selected: no pl.when (it returns nothing)
      at = sw.width - sw.lanes
      kept = kept + jnp.where((row == r) & (lane == c - at) & (c >= aligned), tail, 0.0)
    picked.append(jnp.where((row == r) & (lane == 0) & ~ok, jnp.nan, kept))

  chosen = jnp.sum(tree(jnp.add, jnp.stack(picked)), axis=1, keepdims=True)
  return chosen if sw.inv_t == 1.0 else chosen * sw.inv_t


def patch_chosen(dx_ref, rows, size: int, first_row, ids_ref, value, sw: Sweep):
  """Overwrite each row's chosen column of dx with ``value`` ([size, 1] f32: g * (1 - p_chosen),
  computed once per row in f32 and rounded once). ids_ref: all N ids in SMEM; first_row: the
  group's first row in the whole array. A row at a time: load the [size, lanes] window holding its
  id, select its one element, store (ids outside [0, V) write nothing, as the onehot never matched)."""
  if sw.whole_rows:
    cols, ok = _group_ids(ids_ref, first_row, size, sw)
    old = dx_ref[rows, :]
    hit = (cols == jax.lax.broadcasted_iota(jnp.int32, old.shape, 1)) & ok
    dx_ref[rows, :] = jnp.where(hit, value, old.astype(jnp.float32)).astype(dx_ref.dtype)
    return
  row = jax.lax.broadcasted_iota(jnp.int32, (size, sw.lanes), 0)
  lane = jax.lax.broadcasted_iota(jnp.int32, (size, sw.lanes), 1)

  def visit(r, c, start, ok):
    old = dx_ref[rows, pl.ds(start, sw.lanes)]
    hit = (row == r) & (lane == c - start) & ok
    new = jnp.where(hit, value[r : r + 1, :], old.astype(jnp.float32))
    dx_ref[rows, pl.ds(start, sw.lanes)] = new.astype(dx_ref.dtype)

  _row_windows(ids_ref, first_row, size, sw, visit)
