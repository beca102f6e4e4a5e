"""The Mosaic GPU training-path kernel: statistics, the in-kernel coefficient and dlogits in one CTA.

One CTA owns ``block_n`` (64) rows, as :mod:`kernels.grpo_loss.mosaic_gpu`'s kernels: it streams the
rows' vocabulary tiles through the TMA ring once for the statistics, computes each row's log p and
coefficient g (:func:`kernels.grpo_loss.train.coefficient`, on [bn] row vectors), then streams the
tiles again and writes dlogits through the TMA store ring. One launch instead of two, no [N] round
trip through XLA; the rows' 19 MB (64 x 297 KB) do not stay in L2 between the sweeps, so the logits
are read twice from HBM (2 reads + 1 write). With ``ClusterLossBlocks`` the training kernel is
:mod:`kernels.grpo_loss.mosaic_gpu_cluster`'s instead: rows split across a thread-block cluster, held in
shared memory, read once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import backend
from kernels.grpo_loss import mosaic_gpu as mg
from kernels.grpo_loss import mosaic_gpu_cluster
from kernels.grpo_loss import train as _train
from kernels.grpo_loss.mosaic_gpu_blocks import ClusterLossBlocks, pad_to


def _train_kernel(x_gmem, ids_gmem, tok_gmem, *refs, cfg: _train.TrainConfig, gapped: bool):
  """refs: ([thr_gmem,] the outputs, the scratch ([thr_s,] ...)): with ``gapped`` the rows'
  support thresholds ride beside the ids and both sweeps gap their tiles."""
  thr_gmem, refs = (refs[0], refs[1:]) if gapped else (None, refs)
  lse_gmem, logp_gmem, ent_gmem, dx_gmem, ids_s, tok_s, *thr_s, out_s, ring, bar = refs
  plgpu = backend.mosaic_gpu_module()
  kc = cfg.loss
  wg = plgpu.Layout.WGMMA
  bn, bv = kc.blocks.block_n, kc.blocks.block_v
  cast = lambda x, layout: backend.layout_cast(x, layout, kc.target)
  bcast = lambda a: lax.broadcast_in_dim(a, (bn, bv), [0])
  rows = pl.ds(lax.axis_index("rows") * bn, bn)
  plgpu.copy_gmem_to_smem(ids_gmem.at[rows], ids_s, bar)
  plgpu.copy_gmem_to_smem(tok_gmem.at[:, rows], tok_s, bar)
  if gapped:
    plgpu.copy_gmem_to_smem(thr_gmem.at[rows], thr_s[0], bar)
  plgpu.barrier_wait(bar)
  ids = cast(ids_s[...], wg.reduce(1))  # [bn]
  thr = cast(thr_s[0][...], wg.reduce(1)) if gapped else None
  step = lambda j, x_smem, carry: mg.stats_fold(kc, ids, j, x_smem, carry, thr)
  carry = mg.tile_pipeline(kc, x_gmem, rows, step, mg.stats_init(kc))
  lse, logp, ent = mg.stats_finish(kc, ids, carry)
  tok = {k: cast(tok_s.at[i][...], wg.reduce(1)) for i, k in enumerate(cfg.fields)}
  g = _train.coefficient(cfg, logp, tok)  # [bn], includes 1 / temperature
  args = (bcast(ids), bcast(lse), bcast(g))
  thr_b = None if thr is None else bcast(thr)
  grad = lambda j, x_smem: mg.grad_store(kc, *args, j, x_smem, ring, dx_gmem.at[rows], thr_b)
  mg.tile_pipeline(kc, x_gmem, rows, grad)
  plgpu.wait_smem_to_gmem(0)
  mg.store_rows(out_s, (lse, logp, ent), (lse_gmem, logp_gmem, ent_gmem), rows)


def _train_call(cfg: _train.TrainConfig, x, ids, tok, thr):
  """x [Np, Vp], ids [Np], tok [k, Np], thr [Np] or None -> (lse, logp, entropy [Np] f32,
  dlogits [Np, Vp])."""
  plgpu = backend.mosaic_gpu_module()
  kc = cfg.loss
  n = x.shape[0]
  bn, bv = kc.blocks.block_n, kc.blocks.block_v
  vec = jax.ShapeDtypeStruct((n,), jnp.float32)
  rows = () if thr is None else (thr,)
  return backend.mosaic_gpu_kernel(
    functools.partial(_train_kernel, cfg=cfg, gapped=thr is not None),
    target=kc.target,
    out_type=(vec, vec, vec, jax.ShapeDtypeStruct(x.shape, x.dtype)),
    scratch_types=(
      plgpu.SMEM((bn,), jnp.int32),
      plgpu.SMEM((tok.shape[0], bn), jnp.float32),
      *(plgpu.SMEM((bn,), jnp.float32) for _ in rows),
      plgpu.SMEM((3, bn), jnp.float32),
      plgpu.SMEM(
        (kc.blocks.stages, bn, bv), x.dtype, transforms=backend.smem_transforms(x.dtype, kc.target)
      ),
      plgpu.Barrier(num_arrivals=2 + len(rows)),
    ),
    grid=(n // bn,),
    grid_names=("rows",),
  )(x, ids, tok, *rows)


def train_kernels(cfg: _train.TrainConfig):
  """(stats, train, grad) for :mod:`kernels.grpo_loss.vjp`, on unpadded [N, V] logits; with
  ``ClusterLossBlocks`` the training kernel is the cluster-split one (one read + one write)."""
  kc = cfg.loss

  def stats(x, ids, thr):
    lse, logp, ent = mg.stats_call(kc, x, ids, thr)
    return logp, ent, (lse,)

  def train(x, ids, tok, thr):  # tok: [N, k]; thr: [N] support thresholds or None
    if isinstance(kc.blocks, ClusterLossBlocks):
      lse, logp, ent, dx = mosaic_gpu_cluster.train_fwd(cfg, x, ids, tok, thr)
      return logp, ent, (lse,), dx
    n, v = x.shape
    np_, vp = mg.padded_shape(kc, n, v)
    pad = lambda a: None if a is None else pad_to(a, np_, vp)
    tok_t = jnp.pad(tok.T, ((0, 0), (0, np_ - n)))  # padded rows: weight 0, so g = 0
    lse, logp, ent, dx = _train_call(cfg, pad(x), pad(ids), tok_t, pad(thr))
    return logp[:n], ent[:n], (lse[:n],), dx[:n, :v]

  def grad(x, ids, res, g, thr):
    return mg.grad_call(kc, x, ids, res[0], g, thr)

  return stats, train, grad
