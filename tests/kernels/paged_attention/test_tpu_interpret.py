"""The tiled (TPU) paged attention kernel's DMA pipeline in the TPU interpreter: the plain interpreter
copies at a DMA's start, so it cannot see a wait on the wrong slot or semaphore; ``pltpu.InterpretParams``
lands each copy at its wait, detects races and runs the parallel core axis on two simulated cores
(megacore). The kernel is built for a TPU target (``use_target("tpu", interpret=False)``: its compiler
params and DMA unroll, as compiled) and forced into the interpreter. Ragged lengths, empty sequences,
splits, an odd batch (one core), and stale NaN / inf in every slot past a length, at small blocks;
tests/kernels/test_tpu_interpret.py runs the production blocks of each generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels import backend
from kernels.paged_attention import PagedBlocks, paged_attention_reference
from kernels.paged_attention import pallas as paged_pallas
from kernels.paged_attention.pallas_blocks import PagedConfig
from kernels.paged_attention.reference import combine_splits


def _inputs(b, hkv, g, d, ps, pps, seed):
  rng = np.random.default_rng(seed)
  npages = b * pps + 3
  k = rng.standard_normal((hkv, npages, ps, d)).astype(np.float32)
  v = rng.standard_normal((hkv, npages, ps, d)).astype(np.float32)
  lengths = rng.integers(1, pps * ps, size=b).astype(np.int32)
  lengths[0], lengths[-1] = pps * ps, 0
  table = rng.permutation(npages)[: b * pps].reshape(b, pps).astype(np.int32)
  for bi in range(b):  # a recycled page's stale content in every slot past the length
    for t in range(lengths[bi], pps * ps):
      k[:, table[bi, t // ps], t % ps] = np.nan
      v[:, table[bi, t // ps], t % ps] = np.inf
  table = np.where(np.arange(pps)[None] * ps < lengths[:, None], table, 0).astype(np.int32)
  q = rng.standard_normal((b, hkv * g, d)).astype(np.float32)
  return q, k, v, lengths, table


@pytest.mark.parametrize(
  "b,hkv,ps,pps,ppb,splits",
  [(4, 2, 4, 7, 2, 1), (3, 1, 8, 9, 2, 2)],  # even batch: two cores; odd: one core, two splits
)
def test_tiled_dma_pipeline_in_the_tpu_interpreter(capsys, b, hkv, ps, pps, ppb, splits):
  g, d = 2, 8
  q, k, v, lengths, table = _inputs(b, hkv, g, d, ps, pps, seed=b)
  params = pltpu.InterpretParams(
    dma_execution_mode="on_wait", detect_races=True, num_cores_or_threads=2
  )
  padded = jnp.pad(table, ((0, 0), (0, -pps % (ppb * splits))))
  qg = jnp.asarray(q).reshape(b, hkv, g, d)
  with backend.use_target("tpu", interpret=False, generation="v6e"):
    cfg = PagedConfig(backend.resolve(), PagedBlocks(ppb, splits), d**-0.5)
    with pltpu.force_tpu_interpret_mode(params):
      o, lse = paged_pallas.paged_attention_splits(cfg, qg, k, v, lengths, padded)
      o = jax.block_until_ready(o)
  races = backend.tpu_interpret_races()
  assert not races.found and "RACE DETECTED" not in capsys.readouterr().out
  assert races.cores == ({0, 1} if b % 2 == 0 else {0})  # the core axis: 2 for an even batch
  out = np.asarray(o[0] if splits == 1 else combine_splits(o, lse)).reshape(q.shape)
  ref = paged_attention_reference(q, k, v, lengths, table, scale=d**-0.5)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, np.asarray(ref), rtol=1e-5, atol=1e-5)
