"""Mosaic GPU kernels for the GRPO loss (``impl="mosaic_gpu"``): the Hopper path beside Triton.

Same math as :mod:`kernels.grpo_loss.pallas` (online max / sum-exp / entropy over vocabulary tiles, then
dlogits = g / T * (onehot(id) - softmax(z)) from the saved log-sum-exp), laid out for Hopper:

* one CTA (one warpgroup) owns ``block_n`` (64) token rows and streams their logits through a
  ``stages``-deep ring of shared-memory tiles filled by TMA bulk copies (``plgpu.emit_pipeline``: the
  copy of tile j + stages - 1 is in flight while tile j is reduced), so HBM reads overlap the math;
* tiles sit in shared memory with (8, 128-byte) tiling and the 128-byte swizzle, and are read into the
  WGMMA register layout, whose row reductions (max / sum over the vocab axis) are warpgroup-wide;
* the backward writes dlogits through its own ring of shared-memory tiles with TMA stores
  (``copy_smem_to_gmem``), waiting only until the store that last used a slot has *read* it.

These are the statistics and backward kernels (the three-pass path: sequence-level specs, aux
gradients); the training path's one kernel is :mod:`kernels.grpo_loss.mosaic_gpu_train`, built from the
same pieces (:func:`stats_fold`, :func:`grad_store`, :func:`tile_pipeline`). The policy objective is
the [B, T] XLA math of :mod:`kernels.objective` shared by every impl: all [N, V] traffic is in kernels.

With a support gap (:mod:`kernels.support`) the rows' thresholds ride beside the ids and every tile
is gapped (:func:`kernels.support.gapped`) in the statistics fold and the gradient store.

Launch budget at N 8192, V 151936 bf16 (:func:`kernels.grpo_loss.pallas_blocks.mosaic_budget`, tested):
128 CTAs of 64 rows on 132 SMs, one per SM, 19 MB of logits each, 64 KB in flight per SM (4 stages of
64 x 128 bf16) against ~18 KB that Little's law asks at 80 % of a 3.0 TB/s copy: the forward's one
pass is not starved of loads (1.04 ms at 80 %). Not measured. Shapes that are not multiples
of the tile (N % block_n, V % block_v) are padded by a copy in the wrapper — production shapes
(N = 8192, V = 151936 = 1187 * 128) need none; the padded columns are masked in-kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend, support
from kernels.backend import Target
from kernels.grpo_loss import mosaic_gpu_cluster
from kernels.grpo_loss.mosaic_gpu_blocks import (
  ClusterLossBlocks,
  MosaicLossBlocks,
  MosaicLossConfig,
  check_vocab,
  default_blocks,
  pad_to,
)
from kernels.lse import NEG_BIG, online_step, row_reductions


# -------------------------------------------------------------------------------------------- kernels
def _layouts(cfg):
  """(cast, wg, bcast): layout_cast for this target, the WGMMA layout, [bn] -> [bn, bv] broadcast."""
  wg = backend.mosaic_gpu_module().Layout.WGMMA
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  cast = lambda x, layout: backend.layout_cast(x, layout, cfg.target)
  return cast, wg, lambda a: lax.broadcast_in_dim(a, (bn, bv), [0])


def stats_init(cfg):
  """The running (max, sum-exp, entropy sum, chosen z) of bn rows, [bn] each."""
  cast, wg, _ = _layouts(cfg)
  row_vec = lambda value: cast(jnp.full((cfg.blocks.block_n,), value, jnp.float32), wg.reduce(1))
  return (row_vec(NEG_BIG), row_vec(0.0), row_vec(0.0), row_vec(0.0))


def stats_fold(cfg, ids, j, x_smem, carry, thr=None):
  """Fold vocabulary tile j (in shared memory) into the running statistics; ids: [bn] row layout;
  thr: [bn] the rows' support thresholds (row layout) or None (no gap)."""
  cast, wg, bcast = _layouts(cfg)
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  m, l, s, chosen = carry  # [bn] each
  col = j * bv + cast(lax.broadcasted_iota(jnp.int32, (bn, bv), 1), wg)
  valid = col < cfg.vocab
  z = cast(x_smem[...], wg).astype(jnp.float32) * (1.0 / cfg.temperature)
  z = jnp.where(valid, z, -jnp.inf)
  hit = (col == bcast(ids)) & valid  # a padded column never matches an out-of-range id
  if thr is not None:  # the tile over S (y kept by its column); the chosen z is in S
    z = support.gapped(z, bcast(thr), hit)
  m_new, l, s, _ = online_step(z, valid, m, l, s, **row_reductions(bcast))
  chosen = chosen + jnp.where(hit, z, 0.0).sum(axis=1)
  return m_new, l, s, chosen


def stats_finish(cfg, ids, carry):
  """(lse, logp, entropy), [bn] each, of the final statistics; ids: [bn] row layout. An id outside
  [0, V) (never matched: no row reduction needed to know) gives a NaN logp."""
  m, l, s, chosen = carry
  lse = m + jnp.log(l)
  found = (ids >= 0) & (ids < cfg.vocab)
  return lse, jnp.where(found, chosen - lse, jnp.nan), jnp.log(l) - s / l


def grad_store(cfg, ids, lse, g, j, x_smem, out_s, dx_rows, thr=None):
  """dlogits of tile j into ring slot j % stages, TMA-stored to dx_rows (the CTA's rows of dx).

  ids, lse, g (and thr, the support thresholds, or None): [bn, bv] broadcasts of the rows' values;
  g includes 1 / temperature.
  """
  plgpu = backend.mosaic_gpu_module()
  cast, wg, _ = _layouts(cfg)
  bn, bv, stages = cfg.blocks.block_n, cfg.blocks.block_v, cfg.blocks.stages
  col = j * bv + cast(lax.broadcasted_iota(jnp.int32, (bn, bv), 1), wg)
  z = cast(x_smem[...], wg).astype(jnp.float32) * (1.0 / cfg.temperature)
  hit = col == ids
  if thr is not None:
    z = support.gapped(z, thr, hit)
  # g == 0 (a masked token): exactly 0, even where its logits are NaN / inf (as the Pallas kernels)
  d = jnp.where(g == 0, 0.0, g * (hit.astype(jnp.float32) - jnp.exp(z - lse)))
  slot = lax.rem(j, jnp.int32(stages))
  # The TMA store that last used this slot (step j - stages) must have read it: <= stages - 1 pending.
  plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
  out_s.at[slot][...] = d.astype(out_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_s.at[slot], dx_rows.at[:, pl.ds(j * bv, bv)])


def tile_pipeline(cfg, x_gmem, rows, step, init_carry=None):
  """emit_pipeline over the vocabulary tiles of the CTA's rows: step(j, x_smem[, carry])."""
  plgpu = backend.mosaic_gpu_module()
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  spec = plgpu.BlockSpec(
    (bn, bv), lambda j: (0, j), transforms=backend.smem_transforms(x_gmem.dtype, cfg.target)
  )
  kw = {} if init_carry is None else dict(init_carry=init_carry)
  return plgpu.emit_pipeline(
    (lambda idx, x_smem, *c: step(idx[0], x_smem, *c)),
    grid=(x_gmem.shape[1] // bv,),
    in_specs=[spec],
    max_concurrent_steps=cfg.blocks.stages,
    **kw,
  )(x_gmem.at[rows])


def store_rows(out_s, values, dsts, rows):
  """[bn] row values -> their [Np] outputs through shared memory, by TMA."""
  plgpu = backend.mosaic_gpu_module()
  for k, (val, dst) in enumerate(zip(values, dsts)):
    out_s.at[k][...] = val
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s.at[k], dst.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _fwd_kernel(x_gmem, ids_gmem, *refs, cfg, gapped: bool):
  """refs: ([thr_gmem,] lse, logp, entropy outputs, ids_s, [thr_s,] out_s, bar)."""
  plgpu = backend.mosaic_gpu_module()
  cast, wg, _ = _layouts(cfg)
  thr_gmem, refs = (refs[0], refs[1:]) if gapped else (None, refs)
  lse_gmem, logp_gmem, ent_gmem, ids_s, *row_s, out_s, bar = refs
  rows = pl.ds(lax.axis_index("rows") * cfg.blocks.block_n, cfg.blocks.block_n)
  plgpu.copy_gmem_to_smem(ids_gmem.at[rows], ids_s, bar)
  if gapped:
    plgpu.copy_gmem_to_smem(thr_gmem.at[rows], row_s[0], bar)
  plgpu.barrier_wait(bar)
  ids = cast(ids_s[...], wg.reduce(1))  # [bn]
  thr = cast(row_s[0][...], wg.reduce(1)) if gapped else None
  step = lambda j, x_smem, carry: stats_fold(cfg, ids, j, x_smem, carry, thr)
  carry = tile_pipeline(cfg, x_gmem, rows, step, stats_init(cfg))
  store_rows(out_s, stats_finish(cfg, ids, carry), (lse_gmem, logp_gmem, ent_gmem), rows)


def _bwd_kernel(x_gmem, *refs, cfg):
  """refs: (ids, lse, g[, thr] inputs, dx output, their row scratch, out_s, bar)."""
  plgpu = backend.mosaic_gpu_module()
  cast, wg, bcast = _layouts(cfg)
  rows = pl.ds(lax.axis_index("rows") * cfg.blocks.block_n, cfg.blocks.block_n)
  *ins, dx_gmem, row_s, out_s, bar = refs
  for src, dst in zip(ins, row_s):
    plgpu.copy_gmem_to_smem(src.at[rows], dst, bar)
  plgpu.barrier_wait(bar)
  vals = [bcast(cast(r[...], wg.reduce(1))) for r in row_s]  # ids, lse, g[, thr]
  step = lambda j, x_smem: grad_store(cfg, *vals[:3], j, x_smem, out_s, dx_gmem.at[rows], *vals[3:])
  tile_pipeline(cfg, x_gmem, rows, step)
  plgpu.wait_smem_to_gmem(0)


def fwd_call(cfg: MosaicLossConfig, x, ids, thr=None):
  """x [Np, Vp] (tile multiples), ids [Np] int32, thr [Np] f32 support thresholds or None ->
  (lse, logp, entropy), each [Np] f32."""
  plgpu = backend.mosaic_gpu_module()
  n = x.shape[0]
  bn = cfg.blocks.block_n
  vec = jax.ShapeDtypeStruct((n,), jnp.float32)
  rows = () if thr is None else (thr,)
  return backend.mosaic_gpu_kernel(
    functools.partial(_fwd_kernel, cfg=cfg, gapped=thr is not None),
    target=cfg.target,
    out_type=(vec, vec, vec),
    scratch_types=(
      plgpu.SMEM((bn,), jnp.int32),
      *(plgpu.SMEM((bn,), jnp.float32) for _ in rows),
      plgpu.SMEM((3, bn), jnp.float32),
      plgpu.Barrier(num_arrivals=1 + len(rows)),
    ),
    grid=(n // bn,),
    grid_names=("rows",),
  )(x, ids, *rows)


def bwd_call(cfg: MosaicLossConfig, x, ids, lse, g, thr=None):
  """dlogits [Np, Vp] in x's dtype; g [Np] f32 already includes 1 / temperature; thr [Np] f32
  support thresholds or None."""
  plgpu = backend.mosaic_gpu_module()
  n = x.shape[0]
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  rows = (ids, lse, g) + (() if thr is None else (thr,))
  return backend.mosaic_gpu_kernel(
    functools.partial(_bwd_kernel, cfg=cfg),
    target=cfg.target,
    out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=(
      (plgpu.SMEM((bn,), jnp.int32),) + (plgpu.SMEM((bn,), jnp.float32),) * (len(rows) - 1),
      plgpu.SMEM(
        (cfg.blocks.stages, bn, bv),
        x.dtype,
        transforms=backend.smem_transforms(x.dtype, cfg.target),
      ),
      plgpu.Barrier(num_arrivals=len(rows)),
    ),
    grid=(n // bn,),
    grid_names=("rows",),
  )(x, *rows)


# ------------------------------------------------------------------------------ differentiable op
def padded_shape(cfg: MosaicLossConfig, n: int, v: int) -> tuple[int, int]:
  bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
  return -(-n // bn) * bn, -(-v // bv) * bv


def stats_call(cfg: MosaicLossConfig, logits, ids, thr=None):
  """(lse, logp, entropy) [N] f32 of unpadded logits [N, V] (one read; thr: [N] f32 support
  thresholds or None): the row kernel, or with ``ClusterLossBlocks`` the cluster-split kernel
  (:mod:`kernels.grpo_loss.mosaic_gpu_cluster`)."""
  if not isinstance(cfg.blocks, MosaicLossBlocks):
    return mosaic_gpu_cluster.stats(cfg, logits, ids, thr)
  n, v = logits.shape
  np_, vp = padded_shape(cfg, n, v)
  rows = () if thr is None else (pad_to(thr, np_, vp),)
  return tuple(a[:n] for a in fwd_call(cfg, pad_to(logits, np_, vp), pad_to(ids, np_, vp), *rows))


def grad_call(cfg: MosaicLossConfig, logits, ids, lse, g, thr=None):
  """dlogits [N, V] of the three-pass backward (g [N] f32 includes 1 / temperature; thr: [N] f32
  support thresholds or None): the row kernel, with the default row blocks when ``cfg`` holds
  cluster blocks."""
  if not isinstance(cfg.blocks, MosaicLossBlocks):
    cfg = dataclasses.replace(cfg, blocks=default_blocks(logits.dtype))
  n, v = logits.shape
  np_, vp = padded_shape(cfg, n, v)
  pad = lambda a: None if a is None else pad_to(a, np_, vp)
  return bwd_call(cfg, pad(logits), pad(ids), pad(lse), pad(g), pad(thr))[:n, :v]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _token_logps(cfg: MosaicLossConfig, logits, ids, thr):
  """(logp, entropy) for flat tokens, as :func:`kernels.grpo_loss.pallas.token_logps`.

  logits: [N, V] bf16/f32; ids: [N] int32; thr: [N] f32 support thresholds or None.
  """
  return _vjp_fwd(cfg, logits, ids, thr)[0]


def _vjp_fwd(cfg, logits, ids, thr):
  lse_, logp, entropy = stats_call(cfg, logits, ids, thr)
  return (logp, entropy), (logits, ids, lse_, thr)


def _vjp_bwd(cfg, res, cts):
  logits, ids, lse_, thr = res
  ct_logp, _ = cts  # the entropy carries no gradient
  g = ct_logp * (1.0 / cfg.temperature)
  return grad_call(cfg, logits, ids, lse_, g, thr), None, None


_token_logps.defvjp(_vjp_fwd, _vjp_bwd)


def make_config(
  logits,  # [N, V] bf16/f32
  *,
  target: Target,
  blocks: MosaicLossBlocks | None,
  temperature: float,
  reuse_logits_buffer: bool,
) -> MosaicLossConfig:
  """The checked kernel config of ``kernels.grpo_loss(..., impl="mosaic_gpu")``."""
  backend.check_mosaic_gpu_target(target)
  if reuse_logits_buffer:
    raise ValueError(
      "reuse_logits_buffer is not supported by impl='mosaic_gpu' (plgpu.kernel has no output "
      "aliasing); use impl='pallas' for in-place dlogits"
    )
  if blocks is None:
    blocks = default_blocks(logits.dtype)
  if isinstance(blocks, ClusterLossBlocks):
    check_vocab(logits.shape[1])
    blocks.check(logits.dtype, logits.shape[1])
  elif isinstance(blocks, MosaicLossBlocks):
    blocks.check(logits.dtype)
  else:
    raise TypeError(
      f"blocks for impl='mosaic_gpu' must be MosaicLossBlocks or ClusterLossBlocks, got "
      f"{type(blocks)}"
    )
  return MosaicLossConfig(
    target=target, blocks=blocks, vocab=logits.shape[1], temperature=temperature
  )


def token_logps_cfg(cfg: MosaicLossConfig, logits, ids, thr=None):
  """(logp, entropy) [N] f32 of logits [N, V] and ids [N] (thr: [N] f32 support thresholds or
  None), differentiable through logp (three passes under differentiation: the statistics kernel,
  then the backward kernel)."""
  return _token_logps(cfg, logits, ids, thr)


def token_logps(
  logits,  # [N, V] bf16/f32
  ids,  # [N] int32, 0 at masked positions
  *,
  target: Target,
  blocks: MosaicLossBlocks | None,
  temperature: float,
  reuse_logits_buffer: bool,
):  # -> (logp [N] f32, entropy [N] f32)
  """:func:`token_logps_cfg` after :func:`make_config`."""
  cfg = make_config(
    logits,
    target=target,
    blocks=blocks,
    temperature=temperature,
    reuse_logits_buffer=reuse_logits_buffer,
  )
  return _token_logps(cfg, logits, ids, None)
