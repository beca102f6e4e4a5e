"""The cluster-split Mosaic GPU loss kernels (``impl="mosaic_gpu"``, ``blocks=ClusterLossBlocks``).

QuACK's layout for rows too long for one CTA: a thread-block cluster of ``cluster`` (C) CTAs owns
``rows`` (r) token rows; CTA c bulk-copies (``cp.async.bulk``, one per row, each on its own
barrier) its 1/C column slice of each row into shared memory ONCE (at V 151936 bf16, C 8: 37 KB per
row), computes the slice's partial statistics (max, sum-exp, entropy sum, chosen logit), exchanges
them with its peers around one cluster barrier (:func:`_exchange`: a small global-memory scratch,
since jax 0.11 lowers no access through ``plgpu.cluster_ref``) and combines the C partials exactly
(log-sum-exp of log-sum-exps), then

* forward (statistics): CTA 0 writes the rows' (lse, log p, entropy): one read of the logits;
* training path: every CTA computes the rows' coefficient g (:func:`kernels.grpo_loss.train.coefficient`)
  and overwrites its slice IN SHARED MEMORY with dlogits = g * (onehot - softmax), then bulk-stores
  it: one read of the logits and one write of dlogits in total, the two-pass target of issue 33.

Rows are swept one at a time in ``chunk``-wide 1-D vectors (the warpgroup-strided register layout,
whose full reductions are warpgroup-wide), so the sweep of row 0 starts while rows 1.. are still in
flight. Shapes: slices are whole 128-byte units (a Mosaic GPU bulk copy moves a multiple of 128
bytes), the last CTA's possibly narrower (V 151936 and 128256 bf16 split for C in 1, 2, 4, 8 with
no padding); otherwise, and for N not a multiple of r, the wrapper pads by a copy (test shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend, support
from kernels.grpo_loss import train as _train
from kernels.grpo_loss.mosaic_gpu_blocks import (
  LANES,
  RECORD,
  ClusterLossBlocks,
  MosaicLossConfig,
  pad_to,
  slice_cols,
  smem_bytes,
)
from kernels.grpo_loss.pallas_blocks import Hopper, _budget
from kernels.lse import NEG_BIG, online_step

THR = RECORD - 1  # the info record's column of a row's support threshold (gapped calls)


def cluster_budget(
  n: int, v: int, itemsize: int, blocks: ClusterLossBlocks, hw: Hopper | None = None
):
  """The launch of the cluster kernels at an [n, v] problem (no GPU needed): ``programs`` CTAs in
  n / rows clusters, ``resident_per_sm`` by shared memory (and whole clusters: sms // cluster of
  them at once, GPC packing not modelled), each reading ``rows`` x its slice once, all of it in
  flight at once (one bulk copy per row); the training path reads the logits once
  (``training_reads`` 1) and writes dlogits once, so ``train_ms`` is two passes at 80 % of the
  copy rate. Not measured."""
  hw = Hopper() if hw is None else hw
  dtype = {2: jnp.bfloat16, 4: jnp.float32}[itemsize]
  _, vc, _ = slice_cols(blocks, dtype, v)
  clusters = -(-n // blocks.rows)
  programs = clusters * blocks.cluster
  resident = max(1, hw.smem_per_sm // smem_bytes(blocks, dtype, v))
  concurrent = min(programs, (hw.sms // blocks.cluster) * blocks.cluster * resident)
  per_program = blocks.rows * vc * itemsize
  waves_resident = concurrent / hw.sms  # CTAs per SM actually placed
  return _budget(
    hw, n, v, itemsize, programs, resident, per_program, int(waves_resident * per_program),
    concurrent * per_program, 1,
  )  # fmt: skip


# -------------------------------------------------------------------------------------------- kernel
def _chunk_iota(cfg, dtype):
  """(chunk, column iota [chunk] int32) in the layout a [chunk] shared-memory load infers: each of the
  128 threads holds 8-byte vectors (the warpgroup-strided layout)."""
  chunk = cfg.blocks.chunk
  iota = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  if cfg.target.interpret:
    return chunk, iota
  layout = backend.mosaic_gpu_module().Layout.WG_STRIDED((chunk,), 8 // jnp.dtype(dtype).itemsize)
  return chunk, backend.layout_cast(iota, layout, cfg.target)


def _gap(z, thr, hit):
  """The chunk over S (:func:`kernels.support.gapped`), or z itself without a gap (thr None)."""
  return z if thr is None else support.gapped(z, thr, hit)


def _slice_stats(cfg, x_row, c, vc, cid, thr=None):
  """(max, sum-exp, entropy sum, chosen z) of this CTA's slice of one row; x_row: [Vs] smem; thr:
  the row's support threshold (a scalar) or None."""
  chunk, iota = _chunk_iota(cfg, x_row.dtype)

  def body(k, carry):
    m, l, s, chosen = carry
    col = k * chunk + iota  # local column
    valid = (col < vc) & (c * vc + col < cfg.vocab)
    z = x_row[pl.ds(k * chunk, chunk)].astype(jnp.float32) * (1.0 / cfg.temperature)
    hit = (col == cid) & valid
    z = _gap(jnp.where(valid, z, -jnp.inf), thr, hit)
    m_new, l, s, _ = online_step(z, valid, m, l, s, rmax=jnp.max, rsum=jnp.sum)
    chosen = chosen + jnp.where(hit, z, 0.0).sum()
    return m_new, l, s, chosen

  init = (jnp.float32(NEG_BIG), jnp.float32(0.0), jnp.float32(0.0), jnp.float32(0.0))
  return lax.fori_loop(0, -(-vc // chunk), body, init)


def _combine(parts):
  """Exact combination of the C slices' (max, sum-exp, entropy sum about its max, chosen z), each
  a scalar or a lane vector: the log-sum-exp of log-sum-exps."""
  m = parts[0][0]
  for p in parts[1:]:
    m = jnp.maximum(m, p[0])
  l = s = chosen = None
  for pm, pl_, ps, pc in parts:
    a = jnp.exp(pm - m)  # 0 for an all -inf slice (its max stays NEG_BIG)
    terms = (a * pl_, jnp.where(a == 0, 0.0, a * (ps + (pm - m) * pl_)), pc)
    l, s, chosen = terms if l is None else (l + terms[0], s + terms[1], chosen + terms[2])
  return m, l, s, chosen


def _grad_slice(cfg, x_row, c, vc, cid, lse, g, thr=None):
  """Overwrite the slice with dlogits = g (onehot - softmax); the same thread reads and writes each
  element, so in place is safe. g == 0 (a masked token) gives exact zeros, even over NaN logits.
  thr: the row's support threshold (softmax 0 outside S) or None."""
  chunk, iota = _chunk_iota(cfg, x_row.dtype)

  def body(k, _):
    col = k * chunk + iota
    sl = pl.ds(k * chunk, chunk)
    z = x_row[sl].astype(jnp.float32) * (1.0 / cfg.temperature)
    gv = lax.broadcast_in_dim(g, (chunk,), ())  # a vector predicate: jax 0.11 selects on no scalar
    hit = col == cid
    z = _gap(z, None if thr is None else lax.broadcast_in_dim(thr, (chunk,), ()), hit)
    d = jnp.where(gv == 0, 0.0, gv * (hit.astype(jnp.float32) - jnp.exp(z - lse)))
    x_row[sl] = d.astype(x_row.dtype)
    return 0

  lax.fori_loop(0, -(-vc // chunk), body, 0)


def _by_slice(c, cl, vc, last, fn):
  """fn(columns) with this CTA's static slice width: vc, or ``last`` for the cluster's last CTA."""
  if last == vc:
    fn(vc)
    return
  pl.when(c < cl - 1)(lambda: fn(vc))
  pl.when(c == cl - 1)(lambda: fn(last))


def _exchange(cfg, refs, c, stats_rows):
  """Every CTA's slice partials combined: per row (max, sum-exp, entropy sum, chosen z) scalars.

  Each CTA writes its partials as 4 records of 128 lanes (lane i: row i) to its slot of the
  cluster's global-memory scratch ``xch`` [C, 4, 128] (an extra kernel output, 4 KB per cluster at
  C 8, L2-resident), arrives on a cluster barrier (release at cluster scope), waits for its peers
  (acquire), reads the C records back as coalesced vectors and combines them lane-wise. Not
  distributed shared memory: jax 0.11's Mosaic GPU lowering has no rule for a load or store through
  ``plgpu.cluster_ref`` ("Unsupported memory space: #mosaic_gpu.smem_cluster"; a scalar access
  fails its memref type check), and the interpreter runs neither; this is the pattern of jax's own
  interpreter tests of cluster barriers, so the interpreter runs the same code as the GPU."""
  plgpu = backend.mosaic_gpu_module()
  r, cl = cfg.blocks.rows, cfg.blocks.cluster
  if cl == 1:
    return stats_rows
  xch = refs["xch"].at[lax.axis_index("rows")]
  lanes = lax.broadcasted_iota(jnp.int32, (LANES,), 0)
  if not cfg.target.interpret:
    lanes = backend.layout_cast(lanes, plgpu.Layout.WG_STRIDED((LANES,), 1), cfg.target)
  for k in range(4):
    record = jnp.zeros((LANES,), jnp.float32)
    for i, stats in enumerate(stats_rows):
      record = jnp.where(lanes == i, stats[k], record)
    xch[c, k] = record
  plgpu.barrier_arrive(refs["cbar"].at[0])
  plgpu.barrier_wait(refs["cbar"].at[0])
  combined = _combine([tuple(xch[p, k] for k in range(4)) for p in range(cl)])
  comb_s = refs["comb_s"]
  for k in range(4):
    comb_s[k] = combined[k]
  return [tuple(comb_s[k, i] for k in range(4)) for i in range(r)]


def _kernel(*refs, cfg: MosaicLossConfig, train: _train.TrainConfig | None, names, gapped: bool):
  """One CTA of a cluster: rows [g r, (g + 1) r), columns [c Vc, c Vc + its width); ``gapped``:
  each row's support threshold is its info record's last column (:data:`THR`)."""
  plgpu = backend.mosaic_gpu_module()
  refs = dict(zip(names, refs))
  x_gmem, info_gmem, out_gmem, x_s, info_s, bars = (
    refs[k] for k in ("x", "info", "out", "x_s", "info_s", "bars")
  )
  r, cl = cfg.blocks.rows, cfg.blocks.cluster
  _, vc, last = slice_cols(cfg.blocks, x_gmem.dtype, x_gmem.shape[1])
  c, row0 = lax.axis_index("c"), lax.axis_index("rows") * r
  in_bounds = dict(oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  def load(width):  # one barrier per row: row 0's sweep starts while the others are in flight
    for i in range(r):
      src = x_gmem.at[row0 + i, pl.ds(c * vc, width)]
      plgpu.copy_gmem_to_smem(src, x_s.at[i, pl.ds(0, width)], bars.at[i], **in_bounds)

  _by_slice(c, cl, vc, last, load)
  plgpu.copy_gmem_to_smem(info_gmem.at[pl.ds(row0, r)], info_s, bars.at[r], **in_bounds)
  plgpu.barrier_wait(bars.at[r])
  ids = [info_s[i, 0].astype(jnp.int32) for i in range(r)]
  thrs = [info_s[i, THR] if gapped else None for i in range(r)]
  stats_rows = []
  for i in range(r):
    plgpu.barrier_wait(bars.at[i])
    stats_rows.append(_slice_stats(cfg, x_s.at[i], c, vc, ids[i] - c * vc, thrs[i]))
  parts = _exchange(cfg, refs, c, stats_rows)
  out_s = refs["out_s"]
  for i in range(r):
    m, l, s, chosen = parts[i]
    lse = m + jnp.log(l)
    logp = jnp.where((ids[i] >= 0) & (ids[i] < cfg.vocab), chosen - lse, jnp.nan)
    for k, val in enumerate((lse, logp, jnp.log(l) - s / l)):
      out_s[i, k] = val
    if train is not None:
      tok = {f: info_s[i, 1 + k] for k, f in enumerate(train.fields)}
      g = _train.coefficient(train, logp, tok)  # includes 1 / temperature
      _grad_slice(cfg, x_s.at[i], c, vc, ids[i] - c * vc, lse, g, thrs[i])
  plgpu.commit_smem()

  def store(width):
    for i in range(r):
      dst = refs["dx"].at[row0 + i, pl.ds(c * vc, width)]
      plgpu.copy_smem_to_gmem(x_s.at[i, pl.ds(0, width)], dst)

  if train is not None:
    _by_slice(c, cl, vc, last, store)

  @pl.when(c == 0)
  def _():
    plgpu.copy_smem_to_gmem(out_s, out_gmem.at[pl.ds(row0, r)])

  # No closing cluster barrier: a peer's stores into this CTA's shared memory all precede its
  # arrival, which this CTA waited for; nothing reads a peer's shared memory.
  plgpu.wait_smem_to_gmem(0)


def cluster_call(cfg: MosaicLossConfig, x, info, train: _train.TrainConfig | None = None, gapped: bool = False):  # fmt: skip
  """x [Np, Vp] (Np % rows == 0, Vp split in whole units), info [Np, RECORD] f32 (``gapped``: the
  support thresholds in column :data:`THR`) -> out [Np, RECORD] f32 (lse, logp, entropy,
  unwritten) and, with ``train``, dlogits [Np, Vp]."""
  plgpu = backend.mosaic_gpu_module()
  n, vp = x.shape
  r, cl, chunk = cfg.blocks.rows, cfg.blocks.cluster, cfg.blocks.chunk
  vs = -(-slice_cols(cfg.blocks, x.dtype, vp)[1] // chunk) * chunk
  outs = {"out": jax.ShapeDtypeStruct((n, RECORD), jnp.float32)}
  if train is not None:
    outs["dx"] = jax.ShapeDtypeStruct(x.shape, x.dtype)
  if cl > 1:
    outs["xch"] = jax.ShapeDtypeStruct((n // r, cl, 4, LANES), jnp.float32)
  scratch = {
    "x_s": plgpu.SMEM((r, vs), x.dtype),
    "info_s": plgpu.SMEM((r, RECORD), jnp.float32),
    "comb_s": plgpu.SMEM((4, LANES), jnp.float32),
    "out_s": plgpu.SMEM((r, RECORD), jnp.float32),
    "bars": plgpu.Barrier(num_arrivals=1, num_barriers=r + 1),
  }
  if cl > 1:
    scratch["cbar"] = plgpu.ClusterBarrier(collective_axes=("c",), num_barriers=1)
  names = ("x", "info", *outs, *scratch)
  res = plgpu.kernel(
    functools.partial(_kernel, cfg=cfg, train=train, names=names, gapped=gapped),
    out_type=tuple(outs.values()),
    scratch_types=tuple(scratch.values()),
    grid=(n // r,),
    grid_names=("rows",),
    cluster=(cl,),
    cluster_names=("c",),
    interpret=backend.mosaic_gpu_interpret(cfg.target),
  )(x, info)
  return res[: len(outs) - ("xch" in outs)]


# ------------------------------------------------------------------------------------ the wrappers
def _padded(cfg: MosaicLossConfig, x, ids, tok=None, thr=None):
  """(x, info) padded to the kernel's shapes; info's padded rows have weight 0 (so g = 0); a
  support threshold, if any, in column :data:`THR`."""
  n, v = x.shape
  vp, _, _ = slice_cols(cfg.blocks, x.dtype, v)
  np_ = -(-n // cfg.blocks.rows) * cfg.blocks.rows
  cols = [ids.astype(jnp.float32)[:, None]] + ([] if tok is None else [tok])
  info = jnp.concatenate(cols, axis=1)
  info = jnp.pad(info, ((0, np_ - n), (0, RECORD - info.shape[1])))
  if thr is not None:
    info = info.at[:n, THR].set(thr)
  return pad_to(x, np_, vp), info


def stats(cfg: MosaicLossConfig, x, ids, thr=None):
  """x [N, V], ids [N], thr [N] support thresholds or None -> (lse, logp, entropy) [N] f32: one
  read of the logits."""
  n = x.shape[0]
  (out,) = cluster_call(cfg, *_padded(cfg, x, ids, thr=thr), gapped=thr is not None)
  return out[:n, 0], out[:n, 1], out[:n, 2]


def train_fwd(train: _train.TrainConfig, x, ids, tok, thr=None):
  """x [N, V], ids [N], tok [N, k], thr [N] or None -> (lse, logp, entropy [N] f32, dlogits [N, V])."""
  n, v = x.shape
  info = _padded(train.loss, x, ids, tok, thr)
  out, dx = cluster_call(train.loss, *info, train=train, gapped=thr is not None)
  return out[:n, 0], out[:n, 1], out[:n, 2], dx[:n, :v]
