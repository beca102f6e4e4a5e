"""Kernels on sharded inputs (``sharding=KernelSharding(...)``): on the 8 simulated CPU devices
(tests/conftest.py), the sharded call equals the unsharded one, values and gradients, with the
kernels in interpret mode at tiny shapes; and the sharding value is checked before anything runs.

The TPU side (each kernel compiled inside a sharded program on a 4-chip v6e slice) is in
tests/bench/tpu/test_compile.py; the legality checks behind ``impl="auto"`` at the end of this file."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from bench.tolerances import tolerance
from kernels import backend, ops
from kernels.fused_linear import LinearBlocks
from kernels.fused_linear import pallas_blocks as linear_blocks
from kernels.grpo_loss import OP as LOSS_OP
from kernels.grpo_loss import LossBlocks
from kernels.grpo_loss import pallas_blocks as loss_blocks
from kernels.paged_attention import PagedBlocks
from kernels.paged_attention import pallas_blocks as paged_blocks
from kernels.sharding import KernelSharding
from rl.sharding import make_mesh

MESH = make_mesh(dp=2, fsdp=2, tp=2)  # the loop's (dp, fsdp, tp) axes over 8 CPU devices


def put(x, *spec):
  return jax.device_put(x, NamedSharding(MESH, P(*spec)))


def close(actual, expected, quantity, dtype, length, what):
  tol = tolerance(quantity, dtype, length, float(np.max(np.abs(np.asarray(expected, np.float64)))))
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), err_msg=what, **tol)  # fmt: skip


# --------------------------------------------------------------------------------- the value
def test_kernel_sharding_is_checked_on_construction():
  """Catches: a typo'd axis that shard_map would only reject deep inside a traced step, or an axis
  that splits both the batch and V (each shard would hold the wrong rows' vocabulary)."""
  sh = KernelSharding(MESH, batch_axes="dp")
  assert sh.batch_axes == ("dp",) and sh.batch_shards == 2 and hash(sh) == hash(KernelSharding(MESH, ("dp",)))  # fmt: skip
  assert KernelSharding(MESH, ("dp", "fsdp"), vocab_axis="tp", head_axis="tp").batch_shards == 4
  with pytest.raises(ValueError, match="batch_axes: 'data' is not an axis"):
    KernelSharding(MESH, batch_axes=("data",))
  with pytest.raises(ValueError, match="vocab_axis: 'model' is not an axis"):
    KernelSharding(MESH, vocab_axis="model")
  with pytest.raises(ValueError, match="one role per axis"):
    KernelSharding(MESH, batch_axes=("dp", "tp"), vocab_axis="tp")
  with pytest.raises(ValueError, match="one role per axis"):
    KernelSharding(MESH, batch_axes=("dp", "dp"))
  with pytest.raises(TypeError, match="Mesh"):
    KernelSharding("mesh")
  with pytest.raises(TypeError, match="batch_axes"):
    KernelSharding(MESH, batch_axes=(0,))


def test_batch_that_does_not_split_is_a_value_error_naming_it():
  """Catches: B = 6 over 4 batch shards, which shard_map would reject with an opaque shape error."""
  sh = KernelSharding(MESH, batch_axes=("dp", "fsdp"))
  logits = jnp.zeros((6, 3, 256))
  ids, mask, adv = jnp.zeros((6, 3), jnp.int32), jnp.ones((6, 3), bool), jnp.zeros((6,))
  with pytest.raises(ValueError, match=r"logits: B=6 is not divisible by the 4 shards"):
    kernels.grpo_loss(logits, ids, mask, adv, impl="pallas", sharding=sh)
  h, w = jnp.zeros((6, 3, 16)), jnp.zeros((16, 256))
  with pytest.raises(ValueError, match=r"hidden: B=6"):
    kernels.fused_linear_grpo_loss(h, w, ids, mask, adv, impl="pallas", sharding=sh)
  with pytest.raises(ValueError, match="V=255 is not divisible"):
    tp = KernelSharding(MESH, vocab_axis="tp")
    kernels.fused_linear_grpo_loss(h, jnp.zeros((16, 255)), ids, mask, adv, sharding=tp)
  with pytest.raises(ValueError, match="not both"):
    kernels.fused_linear_grpo_loss(h, w, ids, mask, adv, sharding=tp, mesh=MESH, vocab_axis="tp")


# ---------------------------------------------------------------------------------- grpo_loss
def _loss_inputs(seed, b=8, t=5, v=300):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(b, t, v)) * 2, jnp.float32)
  ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  mask = jnp.asarray(rng.random((b, t)) < 0.8).at[1].set(False)  # one all-masked sequence
  adv = jnp.asarray(rng.normal(size=(b,)), jnp.float32)
  old = jnp.asarray(rng.normal(size=(b, t)) * 0.1 - 5.0, jnp.float32)
  return logits, ids, mask, adv, old


LOSS_OPTIONS = {
  # bnpo / dapo divide by the global token count: a per-shard count would change the loss
  "bnpo-token": dict(loss_type="bnpo"),
  "dapo-on-policy": dict(loss_type="dapo", old=False),
  "grpo-sequence": dict(importance_sampling_level="sequence"),  # three passes (GSPO)
  "grpo-aux-grad": dict(aux_grad=True),  # the three-pass backward through per_token_logps
}


@pytest.mark.parametrize("name", LOSS_OPTIONS)
def test_grpo_loss_sharded_equals_unsharded(name):
  """B = 8 over dp x fsdp (4 shards, tp replicated): loss, aux and dlogits equal the unsharded
  call's. Catches: a reduction taken per shard (grpo's mean over B, bnpo / dapo's token count), rows
  mapped to the wrong shard, blocks sized for the global N (block_n > local N)."""
  opts = dict(LOSS_OPTIONS[name])
  aux_grad, use_old = opts.pop("aux_grad", False), opts.pop("old", True)
  logits, ids, mask, adv, old = _loss_inputs(0)
  sh = KernelSharding(MESH, batch_axes=("dp", "fsdp"))

  def loss(x, ids, mask, adv, old, sharding):
    out, aux = kernels.grpo_loss(
      x, ids, mask, adv, old_logps=old if use_old else None, impl="pallas", platform="cpu",
      blocks=LossBlocks(2, 128), sharding=sharding, **opts,
    )  # fmt: skip
    return (out + jnp.sum(aux.per_token_logps) * 0.01 if aux_grad else out), aux

  run = lambda sharding, *a: jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=5)(*a, sharding)  # fmt: skip
  (want, want_aux), want_g = run(None, logits, ids, mask, adv, old)
  args = (put(logits, ("dp", "fsdp")), put(ids, ("dp", "fsdp")), put(mask, ("dp", "fsdp")))
  args += (put(adv, ("dp", "fsdp")), put(old, ("dp", "fsdp")))
  (got, got_aux), got_g = run(sh, *args)
  v = logits.shape[-1]
  close(got, want, "value", jnp.float32, v, "loss")
  for field in ("per_token_logps", "entropy", "per_token_kl"):
    close(getattr(got_aux, field), getattr(want_aux, field), "value", jnp.float32, v, field)
  close(got_g, want_g, "grad", jnp.float32, v, "dlogits")
  assert got_g.sharding.spec[0] == ("dp", "fsdp")  # dlogits stay split like the logits


# ------------------------------------------------------------------------------- fused_linear
@pytest.mark.parametrize("impl", ["pallas", "chunked"])
@pytest.mark.parametrize("vocab_axis", [None, "tp"], ids=["rows", "rows+tp"])
def test_fused_linear_sharded_equals_unsharded(impl, vocab_axis):
  """B over dp x fsdp, and the head's V over tp or replicated: loss and (dhidden, dlm_head) equal
  the unsharded call's. Catches: dlm_head not summed over the row shards (each shard's partial),
  dhidden not summed over the vocabulary shards, a loss reduced per shard."""
  b, t, hd, v = 8, 5, 32, 300
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.normal(size=(b, t, hd)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(hd, v)) * 0.3, jnp.float32)
  _, ids, mask, adv, old = _loss_inputs(1, b, t, v)
  sh = KernelSharding(MESH, batch_axes=("dp", "fsdp"), vocab_axis=vocab_axis)
  blocks = LinearBlocks(8, 128, 32) if impl == "pallas" else None

  def loss(h, w, ids, mask, adv, old, sharding):
    return kernels.fused_linear_grpo_loss(
      h, w, ids, mask, adv, old_logps=old, loss_type="bnpo", impl=impl, platform="cpu",
      blocks=blocks, chunk_size=4, sharding=sharding,
    )[0]  # fmt: skip

  run = lambda sharding, *a: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=6)(*a, sharding)  # fmt: skip
  want, (want_dh, want_dw) = run(None, h, w, ids, mask, adv, old)
  rows = ("dp", "fsdp")
  args = (put(h, rows), put(w, None, vocab_axis), put(ids, rows), put(mask, rows), put(adv, rows))
  got, (got_dh, got_dw) = run(sh, *args, put(old, rows))
  close(got, want, "value", jnp.float32, v, "loss")
  close(got_dh, want_dh, "grad", jnp.float32, v * hd, "dhidden")
  close(got_dw, want_dw, "grad", jnp.float32, b * t * hd, "dlm_head")


# ---------------------------------------------------------------------------- paged_attention
def test_paged_attention_sharded_equals_unsharded():
  """Sequences over dp, kv heads over tp (q heads follow their kv head), the page pool shared:
  the output equals the unsharded kernel's. Catches: q heads split out of step with their kv head
  (G = 2 heads of the wrong kv head), the pool split over the batch axes (a sequence's pages live
  anywhere), blocks planned for the global batch."""
  b, hq, hkv, d, page, pages = 4, 4, 2, 16, 8, 5
  rng = np.random.default_rng(2)
  pool = b * pages
  q = jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(hkv, pool, page, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(hkv, pool, page, d)), jnp.float32)
  lengths = jnp.asarray([33, 1, 40, 17], jnp.int32)
  table = jnp.asarray(rng.permutation(pool).reshape(b, pages), jnp.int32)  # pages from anywhere
  sh = KernelSharding(MESH, batch_axes=("dp",), head_axis="tp")
  call = dict(impl="pallas", platform="cpu", blocks=PagedBlocks(2, 1))
  want = kernels.paged_attention(q, k, v, lengths, table, **call)
  fn = jax.jit(lambda *a: kernels.paged_attention(*a, **call, sharding=sh))
  got = fn(put(q, "dp", "tp"), put(k, "tp"), put(v, "tp"), put(lengths, "dp"), put(table, "dp"))
  close(got, want, "attention", jnp.float32, pages * page, "attention output")
  assert got.sharding.spec[:2] == ("dp", "tp")
  with pytest.raises(ValueError, match="Hkv=2 is not divisible by the 4 shards"):
    wide = KernelSharding(make_mesh(dp=2, fsdp=1, tp=4), batch_axes=("dp",), head_axis="tp")
    kernels.paged_attention(q, k, v, lengths, table, **call, sharding=wide)


# ------------------------------------------------------------------ legality behind impl="auto"
V4, V6E = (backend.make_target("tpu", interpret=False, generation=g) for g in ("v4", "v6e"))


def test_loss_blocks_legal_on_each_generation():
  """The training kernel keeps a [rows, V] block in and its dlogits out in VMEM: at V = 151936 bf16
  v4's 16 MiB takes 8 rows (compiled: 40 rows need 24.3 MB windows there), f32 not even 8; v6e takes
  16 (half its VMEM, at most 24 MiB of blocks); at f32 on v4 the heuristic tiles the vocabulary
  instead. Catches: a heuristic sized for v6e on v4, a legal_on that passes what cannot compile, a
  vocabulary v4 refuses."""
  shape = dict(tokens=8192, vocab=151936, dtype="bfloat16")
  heuristic = loss_blocks.default_blocks(V4, 8192, 151936, "bfloat16")
  assert not heuristic.vocab_tiled and loss_blocks.legal_on(V4, heuristic, shape) is None
  f32 = loss_blocks.default_blocks(V4, 8192, 151936, "float32")
  assert f32.vocab_tiled and loss_blocks.legal_on(V4, f32, dict(shape, dtype="float32")) is None
  assert not loss_blocks.default_blocks(V6E, 8192, 151936, "float32").vocab_tiled
  assert loss_blocks.stats_rows(128, 8192, 151936, "bfloat16", V4, blocks=2) == 8
  assert loss_blocks.stats_rows(128, 8192, 151936, "bfloat16", V6E, blocks=2) == 16
  assert "16 MiB" in loss_blocks.legal_on(V4, heuristic, dict(shape, dtype="float32"))
  assert loss_blocks.legal_on(V6E, heuristic, dict(shape, dtype="float32")) is None
  assert "scoped default" in loss_blocks.legal_on(V4, LossBlocks(512, 16384), shape)
  assert "multiple of 128" in loss_blocks.legal_on(V6E, LossBlocks(128, 1000), shape)
  with pytest.raises(ValueError, match="16 MiB"):  # an explicit impl is refused, never compiled
    ops.fallback(LOSS_OP, "pallas", "over the 16 MiB there")
  with pytest.warns(UserWarning, match="XLA reference"):
    assert ops.fallback(LOSS_OP, "auto", "over the 16 MiB there") == "xla"


def test_grpo_loss_v4_f32_tiles_the_vocabulary():
  """f32 logits at V = 151936 on v4 (issue 52: refused, then run by XLA): impl='auto' runs the
  kernels (the heuristic's vocab-tiled blocks), with no fallback warning; whole-row blocks given
  explicitly are still a ValueError naming the training kernel, before tracing reaches Mosaic."""
  x = jax.ShapeDtypeStruct((8, 4, 151936), jnp.float32)
  ids, mask = jax.ShapeDtypeStruct((8, 4), jnp.int32), jax.ShapeDtypeStruct((8, 4), jnp.bool_)
  adv = jax.ShapeDtypeStruct((8,), jnp.float32)
  with backend.use_target("tpu", interpret=False, generation="v4"):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      text = jax.jit(lambda *a: kernels.grpo_loss(*a)[0]).trace(x, ids, mask, adv).lower(lowering_platforms=("tpu",)).as_text()  # fmt: skip
    assert backend.LOWERED_KERNEL_MARKERS["tpu"] in text
    with pytest.raises(ValueError, match="training kernel"):
      whole_rows = LossBlocks(16, 4096)
      jax.eval_shape(lambda *a: kernels.grpo_loss(*a, impl="pallas", blocks=whole_rows)[0], x, ids, mask, adv)  # fmt: skip


def test_linear_blocks_per_generation():
  """The fused kernels' dweight step holds an [H, bv] f32 accumulator: (256, 512) at H = 2048 is
  18.5 MiB compiled on v4 (16 MiB), so v4 and an unnamed TPU get (256, 256); the single-core
  generations' one gradient kernel (issue 51) takes (512, 1536) on v6e, and (512, 512) on v7x, whose
  64 MiB hold too few dh rows for the one kernel at (512, 1536) or (512, 768).
  Catches: one heuristic for every generation, an explicit illegal tile reaching Mosaic, a tile
  that sends v7x to the dhidden + dweight split (10 N·H·V flops instead of 8)."""
  shape = dict(tokens=8192, hidden=2048, vocab=151936, dtype="bfloat16")
  unnamed = backend.make_target("tpu", interpret=False)
  assert linear_blocks.default_blocks(V6E, 8192, 2048, 151936) == LinearBlocks(512, 1536, 2048)
  v7x = backend.make_target("tpu", interpret=False, generation="v7x")
  b7 = linear_blocks.default_blocks(v7x, 8192, 2048, 151936)
  assert b7 == LinearBlocks(512, 512, 2048) and linear_blocks.fused_rows(b7, 8192, 2048, 2, v7x) > 0
  for target in (V4, unnamed):
    b = linear_blocks.default_blocks(target, 8192, 2048, 151936)
    assert b == LinearBlocks(256, 256, 2048) and linear_blocks.legal_on(target, b, shape) is None
  assert "dweight" in linear_blocks.legal_on(V4, LinearBlocks(256, 512, 2048), shape)
  assert linear_blocks.legal_on(V6E, LinearBlocks(256, 512, 2048), shape) is None
  assert "must divide H" in linear_blocks.legal_on(V6E, LinearBlocks(256, 512, 1000), shape)


def test_paged_blocks_legal_on():
  shape = dict(dtype="bfloat16", batch=64, q_heads=16, kv_heads=2, head_dim=128, page_size=16, ctx=4096)  # fmt: skip
  default = paged_blocks.default_blocks(V4, 64, 2, 256, 16)
  assert paged_blocks.legal_on(V4, default, shape) is None
  assert "scoped default" in paged_blocks.legal_on(V4, PagedBlocks(1024), shape)
  assert "page_size" in paged_blocks.legal_on(V4, default, dict(shape, page_size=4))
