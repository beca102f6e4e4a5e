"""The fused head's TPU kernels in the CPU interpreter, kernel by kernel: the per-lane statistics
(:func:`kernels.fused_linear.pallas_tpu.stats`) against the definition, and the one-kernel gradients
(:mod:`kernels.fused_linear.pallas_tpu_grads`) against the two-kernel path and the definition, in
one call and over row superblocks (the dw carried in f32 from call to call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.tolerances import assert_close
from kernels import backend
from kernels.fused_linear import pallas_tpu, pallas_tpu_grads
from kernels.fused_linear.pallas_blocks import LinearBlocks, fused_rows
from kernels.fused_linear.reference import linear_logits, vocab_stats_reference


def _problem(n, hd, v, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], (n, hd), jnp.float32).astype(dtype)  # [N, H]
  w = (jax.random.normal(k[1], (hd, v), jnp.float32) * 2.0 / hd**0.5).astype(dtype)  # [H, V]
  ids = jax.random.randint(k[2], (n,), 0, v, jnp.int32)  # [N]
  g = jax.random.normal(k[3], (n,), jnp.float32)  # [N]
  return h, w, ids, g


def _cfg(blocks, v, temperature=1.0):
  return pallas_tpu.FusedConfig(backend.resolve("cpu", True), blocks, v, temperature)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
  "n,v,blocks,temperature",
  [
    (37, 300, LinearBlocks(8, 128, 64), 0.8),  # ragged rows and vocabulary, several lanes' slabs
    (40, 300, LinearBlocks(40, 300, 32), 1.0),  # block_v = V (no multiple of 128), H split in two
    (64, 512, LinearBlocks(16, 256, 64), 1.3),  # whole blocks
  ],
)
def test_stats_equal_definition(n, v, blocks, temperature, dtype):
  """Catches: a lane's stream folded with another's max, the tail block's columns past V counted
  (the mask is on the last slabs only), an id's column compared without the block offset, per-lane
  statistics not reset at a new row block, the k-split accumulator not reset."""
  h, w, ids, _ = _problem(n, 64, v, jnp.dtype(dtype))
  ids = ids.at[3].set(v + 7)  # another shard's token: not found, chosen 0
  got = pallas_tpu.stats(_cfg(blocks, v, temperature), h, w, ids)
  want = vocab_stats_reference(h, w, ids, temperature)
  for name, a, b in zip(("lse", "chosen", "found", "E[z]"), got, want):
    assert_close(a, b, "value", jnp.float32, 64 + v, err_msg=name)
  assert float(got[2][3]) == 0.0 and float(got[1][3]) == 0.0


def _grads_reference(h, w, ids, lse, g, temperature):
  """dh, dw of sum_n g[n] * (z[n, id] - lse[n]) by autodiff of the definition (f32)."""
  h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)

  def f(h, w):
    z = linear_logits(h, w) / temperature
    chosen = jnp.take_along_axis(z, ids[:, None], 1)[:, 0]
    return jnp.sum(g * temperature * (chosen - jax.nn.logsumexp(z, axis=1)))

  return jax.grad(f, argnums=(0, 1))(h32, w32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [None, 16, 24])
def test_one_kernel_grads_equal_two_kernels_and_definition(rows, dtype):
  """Catches: dh accumulated from stale VMEM at the first vocabulary block, dw's accumulator not
  restarted at a new vocabulary block, the weight tile's columns past V (NaN garbage) reaching
  dl @ w^T because the tail step is read off the wrong grid axis, the tail row block's rows past R
  reaching dw, a superblock's dw not carried into the next call (rows=16, 24: three calls, the last
  ragged)."""
  n, hd, v, temp = 45, 64, 300, 0.8
  dt = jnp.dtype(dtype)
  h, w, ids, g = _problem(n, hd, v, dt, seed=1)
  w = w.at[:, -1].set(jnp.nan)  # a NaN column is real data: it must poison dw's column only
  w_ok = w.at[:, -1].set(0)
  lse = vocab_stats_reference(h, w_ok, ids, temp)[0]
  cfg = _cfg(LinearBlocks(8, 128, 64), v, temp)
  dh, dw = pallas_tpu_grads.grads(cfg, h, w_ok, ids, lse, g / temp, dt, dt, rows=rows)
  dh2, dw2 = pallas_tpu.grads(cfg, h, w_ok, ids, lse, g / temp, dt, dt)
  ref_dh, ref_dw = _grads_reference(h, w_ok, ids, lse, g / temp, temp)
  assert_close(dh, ref_dh, "grad", dt, v, err_msg="dhidden")
  assert_close(dw, ref_dw, "grad", dt, n, err_msg="dweight")
  assert_close(dh, dh2, "grad", dt, v, err_msg="dhidden vs two kernels")
  assert_close(dw, dw2, "grad", dt, n, err_msg="dweight vs two kernels")
  assert np.isfinite(np.asarray(dh, np.float32)).all()


def test_fused_rows_by_generation():
  """Catches: the one-kernel path chosen on a megacore chip (its grid cannot split over the two
  cores) or where its resident dh outgrows VMEM; superblocks of whole row blocks otherwise."""
  b = LinearBlocks(512, 512, 2048)
  with backend.use_target("tpu", interpret=False, generation="v6e"):
    v6e = backend.resolve()
  with backend.use_target("tpu", interpret=False, generation="v4"):
    v4 = backend.resolve()
  assert fused_rows(b, 8192, 2048, 2, v6e) == 8192  # dh [8192, 2048] f32 resident: 64 MiB
  r = fused_rows(b, 16384, 2048, 2, v6e)
  assert 2048 <= r < 16384 and r % 512 == 0
  assert fused_rows(LinearBlocks(256, 256, 2048), 8192, 2048, 2, v4) == 0


def _gapped(h, w, temperature: float, seed: int):
  """(ids [N], thr [N] f32, keep [N, V] bool): ids among each row's top 3, thresholds of a top-k
  set cut at the midpoint of two logits (-inf for every fourth row and where the two are within
  0.02: the set there is the rounding's choice), keep: the set S (y always in it)."""
  rng = np.random.default_rng(seed)
  z = np.asarray(linear_logits(h, w), np.float32) / temperature
  n, v = z.shape
  ar, order, zs = np.arange(n), np.argsort(-z, 1), -np.sort(-z, 1)
  rank = rng.integers(0, 3, n)
  k = np.minimum(rank + rng.integers(1, 10, n), v - 1)
  thr = (zs[ar, k - 1] + zs[ar, k]) / 2
  thr[(ar % 4 == 0) | (zs[ar, k - 1] - zs[ar, k] < 0.02)] = -np.inf
  ids = order[ar, rank]
  keep = (z >= thr[:, None]) | (np.arange(v) == ids[:, None])
  return jnp.asarray(ids, jnp.int32), jnp.asarray(thr, jnp.float32), jnp.asarray(keep)


def test_gapped_stats_and_grads_equal_definition(dtype="bfloat16"):
  """The support thresholds in the statistics kernel, the one gradient kernel over row superblocks
  and the dhidden / dweight kernels (the megacore path), against the definition over S. Catches: a
  kernel that ignores the thresholds (the other two still pass the loss tests' parity only if
  every sweep applies them), y's column matched without the block offset (y dropped from S), the
  thresholds' row block offset wrong in a superblock after the first."""
  n, hd, v, temp = 45, 64, 300, 0.8
  dt = jnp.dtype(dtype)
  h, w, _, g = _problem(n, hd, v, dt, seed=2)
  ids, thr, keep = _gapped(h, w, temp, seed=2)
  cfg = _cfg(LinearBlocks(8, 128, 64), v, temp)
  z = jnp.where(keep, linear_logits(h, w) / temp, -jnp.inf)
  lse = jax.nn.logsumexp(z, axis=1)
  p = jnp.exp(z - lse[:, None])
  want = (lse, jnp.take_along_axis(z, ids[:, None], 1)[:, 0], jnp.ones(n), jnp.sum(jnp.where(keep, p * z, 0.0), 1))  # fmt: skip
  got = pallas_tpu.stats(cfg, h, w, ids, thr)
  for name, a, b in zip(("lse", "chosen", "found", "E[z]"), got, want):
    assert_close(a, b, "value", jnp.float32, 64 + v, err_msg=f"gapped {name}")

  def f(h, w):  # sum_n g[n] T (z_y - lse over S), S fixed (a step function of the logits)
    zz = jnp.where(keep, linear_logits(h, w) / temp, -jnp.inf)
    chosen = jnp.take_along_axis(zz, ids[:, None], 1)[:, 0]
    return jnp.sum(g * (chosen - jax.nn.logsumexp(zz, axis=1)))

  ref_dh, ref_dw = jax.grad(f, argnums=(0, 1))(h.astype(jnp.float32), w.astype(jnp.float32))
  one = pallas_tpu_grads.grads(cfg, h, w, ids, lse, g / temp, dt, dt, rows=16, thr=thr)
  two = pallas_tpu.grads(cfg, h, w, ids, lse, g / temp, dt, dt, thr)
  for name, (dh, dw) in (("one kernel", one), ("two kernels", two)):
    assert_close(dh, ref_dh, "grad", dt, v, err_msg=f"gapped dhidden, {name}")
    assert_close(dw, ref_dw, "grad", dt, n, err_msg=f"gapped dweight, {name}")
