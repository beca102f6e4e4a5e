"""The fused LM-head GRPO loss: parity with grpo_loss(hidden @ lm_head) (values and both gradients) for
the fused Pallas kernels and the chunked path, tensor parallelism on 8 CPU devices, memory, errors."""

import dataclasses
import json
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import kernels
from bench.shapes import LINEAR_LOSS_SHAPES
from bench.tolerances import assert_close
from kernels import autotune, backend, fused_linear
from kernels.fused_linear import OP as FUSED_OP
from kernels.fused_linear import (
  ChunkBlocks,
  LinearBlocks,
  MosaicLinearBlocks,
  vocab_stats_reference,
)
from kernels.fused_linear.impls import shape_key
from kernels.grpo_loss.reference import LOSS_TYPES
from rl.sharding import make_mesh
from tests.problems import epsilon_sensitive_tokens, loss_scale, policy_kwargs

# (impl, platform): the fused kernels in the interpreter; the chunked path with grpo_loss's tiled
# kernels (TPU family) and its rowloop kernels (the Triton family) in the interpreter.
PATHS = [("pallas", "cpu"), ("chunked", "cpu"), ("chunked", "gpu")]
# Unequal epsilons everywhere: a path that swaps or merges them must fail.
OPTIONS = {
  "on_policy": dict(epsilon_low=0.1, epsilon_high=0.3),
  "off_policy_kl_temp": dict(
    off_policy=True, beta=0.04, temperature=0.8, epsilon_low=0.12, epsilon_high=0.28
  ),
}
IMPLS = [("xla", "cpu"), *PATHS]


def make_problem(b, t, hd, v, dtype, *, off_policy=False, beta=0.0, seed=0, **options):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(b, t, hd)), dtype)
  lm_head = jnp.asarray(rng.normal(size=(hd, v)) * 2.0 / np.sqrt(hd), dtype)
  ids = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  mask = rng.random((b, t)) < 0.8
  mask[rng.integers(b)] = False  # an empty row
  logits = (
    np.asarray(hidden, np.float32)
    @ np.asarray(lm_head, np.float32)
    / options.get("temperature", 1.0)
  )
  logp = np.take_along_axis(jax.nn.log_softmax(logits), np.asarray(ids)[..., None], -1)[..., 0]
  kw = policy_kwargs(rng, logp, options, off_policy=off_policy, beta=beta)
  return (hidden, lm_head, ids, jnp.asarray(mask), jnp.asarray(rng.normal(size=b), jnp.float32)), kw


def value_and_grads(fn, args, kw, **call_kw):
  def loss(h, w):
    return fn(h, w, *args[2:], **kw, **call_kw)

  (value, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(*args[:2])
  return value, aux, grads


def reference(args, kw, **call_kw):
  """The definition, in f32 whatever the inputs' dtype (the issue's parity target)."""
  f32 = (args[0].astype(jnp.float32), args[1].astype(jnp.float32)) + args[2:]
  return value_and_grads(kernels.fused_linear_grpo_loss, f32, kw, impl="xla", **call_kw)


def assert_parity(args, kw, impl, platform, loss_types=("grpo",), interpret=True, **call_kw):
  hidden, lm_head = args[:2]
  (b, t, hd), v = hidden.shape, lm_head.shape[1]
  dtype = hidden.dtype
  for loss_type in loss_types:
    value, aux, (dh, dw) = value_and_grads(
      kernels.fused_linear_grpo_loss,
      args,
      kw,
      loss_type=loss_type,
      impl=impl,
      platform=platform,
      interpret=interpret,
      **call_kw,
    )
    r_value, r_aux, (r_dh, r_dw) = reference(args, kw, loss_type=loss_type)
    msg = f"{impl}/{platform} {loss_type} {dtype.name}"
    assert dh.dtype == dtype and dw.dtype == dtype
    # logits accumulate over H, the log-sum-exp over V; dh sums over V, dw over the N tokens
    scale = max(loss_scale(r_aux, args[3], args[4], kw), float(abs(r_value)))
    assert_close(value, r_value, "value", jnp.float32, hd + v, err_msg=msg, scale=scale)
    for name in ("per_token_logps", "entropy"):
      assert_close(
        getattr(aux, name),
        getattr(r_aux, name),
        "value",
        jnp.float32,
        hd + v,
        err_msg=f"{msg} {name}",
      )
    # KL = exp(d) - d - 1 with d = ref - logp cancels: its rounding is logp's, times |dKL/dlogp| = |e^d - 1|.
    r_logp = np.asarray(r_aux.per_token_logps, np.float64)
    d = (
      np.asarray(kw["ref_logps"], np.float64) - r_logp
      if kw.get("ref_logps") is not None
      else 0.0 * r_logp
    )
    kl_scale = max(
      float(np.max(np.abs(r_logp)) * np.max(np.abs(np.expm1(d)))),
      float(np.max(np.abs(r_aux.per_token_kl))),
    )
    assert_close(
      aux.per_token_kl,
      r_aux.per_token_kl,
      "value",
      jnp.float32,
      hd + v,
      err_msg=f"{msg} kl",
      scale=kl_scale,
    )
    np.testing.assert_array_equal(aux.is_clipped, r_aux.is_clipped)
    # dlogits = C (p - onehot) per token (C: the loss's weight on that token's log-prob), and p_y - 1
    # cancels when p_y ~ 1: dh = dlogits @ W^T and dW = h^T @ dlogits round relative to C, not to their
    # own (possibly cancelled) size. C = sum |dlogits| / (2 (1 - p_y)), from the reference in float64.
    h32, w32 = np.asarray(hidden, np.float32), np.asarray(lm_head, np.float32)
    g = np.abs(
      np.asarray(
        jax.grad(
          lambda x: kernels.grpo_loss(x, *args[2:], loss_type=loss_type, impl="xla", **kw)[0]  # noqa: B023 (called at once)
        )(jnp.asarray(h32 @ w32)),
        np.float64,
      )
    )
    p_y = np.exp(np.asarray(r_aux.per_token_logps, np.float64))
    c = g.sum(-1) / (
      2.0 * np.maximum(1.0 - p_y, np.finfo(np.float32).eps)
    )  # [B, T]; p_y rounds to 1 below eps
    dh_scale = max(float(np.max(c)) * 2.0 * float(np.max(np.abs(w32))), float(np.max(np.abs(r_dh))))
    dw_scale = max(
      2.0 * float(np.max(c.reshape(-1) @ np.abs(h32.reshape(-1, hd)))), float(np.max(np.abs(r_dw)))
    )
    assert_close(dh, r_dh, "grad", dtype, hd + v, err_msg=f"{msg} dhidden", scale=dh_scale)
    assert_close(dw, r_dw, "grad", dtype, b * t + hd, err_msg=f"{msg} dlm_head", scale=dw_scale)
  return r_aux


# ------------------------------------------------------------------------------------- reference
def test_vocab_stats_reference_by_hand():
  # one token, H = 1, z = [1, 2, 3] (hidden 1, lm_head [[1, 2, 3]]), chosen id 2
  lse, chosen, found, ez = vocab_stats_reference(
    jnp.ones((1, 1)), jnp.array([[1.0, 2.0, 3.0]]), jnp.array([2])
  )
  p = np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum()
  np.testing.assert_allclose(lse, [np.log(np.exp([1, 2, 3]).sum())], rtol=1e-6)
  np.testing.assert_allclose(chosen, [3.0])
  np.testing.assert_allclose(found, [1.0])
  np.testing.assert_allclose(ez, [(p * [1, 2, 3]).sum()], rtol=1e-6)
  _, chosen, found, _ = vocab_stats_reference(
    jnp.ones((1, 1)), jnp.array([[1.0, 2.0, 3.0]]), jnp.array([5])
  )
  assert float(chosen[0]) == 0.0 and float(found[0]) == 0.0  # not in this shard


# ---------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("impl,platform", PATHS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parity(impl, platform, option, dtype):
  s = LINEAR_LOSS_SHAPES["tiny"]
  args, kw = make_problem(s.batch, s.seq, s.hidden, s.vocab, jnp.dtype(dtype), **OPTIONS[option])
  blocks = LinearBlocks(8, 256, 32) if impl == "pallas" else None  # several tiles on every axis
  r_aux = assert_parity(
    args,
    kw,
    impl,
    platform,
    loss_types=LOSS_TYPES if option == "on_policy" else ("grpo",),
    blocks=blocks,
    chunk_size=4,
  )
  if "old_logps" in kw:  # the data must be able to tell epsilon_low from epsilon_high
    assert epsilon_sensitive_tokens(r_aux, args[3], args[4], kw) > 0


@given(
  b=st.integers(1, 3),
  t=st.integers(1, 9),
  hd=st.sampled_from([16, 48, 64]),
  v=st.integers(2, 700),
  bn=st.sampled_from([8, 16]),
  bv=st.sampled_from([128, 256]),
  chunk=st.integers(1, 16),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  path=st.sampled_from(PATHS),
  seed=st.integers(0, 2**31),
)
def test_parity_hypothesis(b, t, hd, v, bn, bv, chunk, dtype, path, seed):
  args, kw = make_problem(b, t, hd, v, jnp.dtype(dtype), seed=seed, **OPTIONS["off_policy_kl_temp"])
  bh = 16 if hd % 32 else 32  # several hidden tiles when H allows
  assert_parity(
    args,
    kw,
    *path,
    blocks=LinearBlocks(bn, bv, bh) if path[0] == "pallas" else None,
    chunk_size=chunk,
  )


def test_default_blocks_and_chunk_at_cpu_size():
  s = LINEAR_LOSS_SHAPES["cpu-small"]
  args, kw = make_problem(
    s.batch, s.seq, s.hidden, s.vocab, jnp.dtype(s.dtype), off_policy=True, epsilon_low=0.15
  )
  assert_parity(args, kw, "pallas", "cpu")
  assert_parity(args, kw, "chunked", "cpu")


def test_matches_grpo_loss_on_materialised_logits():
  """Same op as kernels.grpo_loss(hidden @ lm_head): identical per-token outputs and loss."""
  args, kw = make_problem(2, 5, 32, 300, jnp.float32, off_policy=True, beta=0.1)
  logits = jnp.einsum("bth,hv->btv", args[0], args[1])
  plain, plain_aux = kernels.grpo_loss(logits, *args[2:], **kw, impl="pallas", interpret=True)
  for impl in ("chunked", "pallas"):  # undifferentiated: the statistics-only pass
    fused, aux = kernels.fused_linear_grpo_loss(*args, **kw, impl=impl, interpret=True)
    assert_close(fused, plain, "value", jnp.float32, 32 + 300, err_msg=impl)
    assert_close(
      aux.per_token_logps, plain_aux.per_token_logps, "value", jnp.float32, 32 + 300, err_msg=impl
    )


# ------------------------------------------------------------------- the LossSpec options
# One token-level set (the chunked path's one-pass gradients) and two sequence-level ones (statistics
# pass, then the gradient pass), each with data that activates it.
NEW_OPTIONS = {
  "tis_token_dual_clip": dict(
    off_policy=True, is_mode="token_truncate", is_cap=1.2, epsilon_c=1.1, epsilon_high=0.3
  ),
  "gspo_sequence_mask": dict(
    off_policy=True,
    beta=0.04,
    temperature=0.8,
    is_mode="sequence_mask",
    is_cap=1.3,
    importance_sampling_level="sequence",
    epsilon_low=0.12,
  ),
  "gspo_on_policy_seq_trunc": dict(
    importance_sampling_level="sequence", is_mode="sequence_truncate", is_cap=1.2, epsilon_c=1.05
  ),
}


def options_problem(b, t, hd, v, dtype, option, seed=0):
  args, kw = make_problem(b, t, hd, v, dtype, seed=seed, **NEW_OPTIONS[option])
  base = kw.get("old_logps")
  if base is None:
    f32 = (args[0].astype(jnp.float32), args[1].astype(jnp.float32), *args[2:])
    temp = kw.get("temperature", 1.0)
    base = kernels.fused_linear_grpo_loss(*f32, impl="xla", temperature=temp)[1].per_token_logps
  rng = np.random.default_rng(seed + 100)
  kw["sampler_logps"] = jnp.asarray(base + rng.normal(scale=0.3, size=(b, t)), jnp.float32)
  return args, kw


def assert_new_aux(args, kw, impl, platform, **call_kw):
  """is_weight and sampler_log_ratio (not compared by assert_parity) against the reference."""
  _, aux, _ = value_and_grads(
    kernels.fused_linear_grpo_loss,
    args,
    kw,
    impl=impl,
    platform=platform,
    interpret=True,
    **call_kw,
  )
  _, r_aux, _ = reference(args, kw)
  v = args[1].shape[1]
  for name in ("is_weight", "sampler_log_ratio"):
    a, e = getattr(aux, name), getattr(r_aux, name)
    assert_close(a, e, "value", jnp.float32, v, f"{impl}/{platform} {name}")
  return r_aux


@pytest.mark.parametrize("impl,platform", PATHS)
@pytest.mark.parametrize("option", sorted(NEW_OPTIONS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parity_new_options(impl, platform, option, dtype):
  s = LINEAR_LOSS_SHAPES["tiny"]
  args, kw = options_problem(s.batch, s.seq, s.hidden, s.vocab, jnp.dtype(dtype), option)
  call = dict(blocks=LinearBlocks(8, 256, 32) if impl == "pallas" else None, chunk_size=4)
  loss_types = LOSS_TYPES if dtype == "float32" else ("grpo",)
  assert_parity(args, kw, impl, platform, loss_types=loss_types, **call)
  r_aux = assert_new_aux(args, kw, impl, platform, **call)
  w = np.asarray(r_aux.is_weight)[np.asarray(args[3])]
  assert (w != 1.0).any(), "the importance weights must be active in this data"


@given(
  b=st.integers(1, 3),
  t=st.integers(1, 9),
  hd=st.sampled_from([16, 48]),
  v=st.integers(2, 500),
  chunk=st.integers(1, 16),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  path=st.sampled_from(PATHS),
  option=st.sampled_from(sorted(NEW_OPTIONS)),
  seed=st.integers(0, 2**31),
)
def test_parity_new_options_hypothesis(b, t, hd, v, chunk, dtype, path, option, seed):
  args, kw = options_problem(b, t, hd, v, jnp.dtype(dtype), option, seed=seed)
  blocks = LinearBlocks(8, 128, 16) if path[0] == "pallas" else None
  assert_parity(args, kw, *path, blocks=blocks, chunk_size=chunk)


@pytest.mark.parametrize("impl,platform", IMPLS)
def test_per_token_advantages_in_every_impl(impl, platform):
  """[B, T] advantages repeating each row's value: bit for bit the [B] result; genuinely per-token
  ones: parity with the reference (and a different loss than the broadcast first value)."""
  args, kw = options_problem(3, 4, 16, 200, jnp.float32, "gspo_sequence_mask", seed=7)
  per_seq = _run(args, kw, impl, platform)
  tiled = (*args[:4], jnp.broadcast_to(args[4][:, None], args[2].shape))
  for a, e in zip(jax.tree.leaves(_run(tiled, kw, impl, platform)), jax.tree.leaves(per_seq)):
    np.testing.assert_array_equal(a, e, err_msg=impl)
  adv = jnp.asarray(np.random.default_rng(8).normal(size=args[2].shape), jnp.float32)
  per_tok = (*args[:4], adv)
  value, _, (dh, dw) = _run(per_tok, kw, impl, platform)
  r_value, _, (r_dh, r_dw) = reference(per_tok, kw)
  assert float(r_value) != float(reference(tiled, kw)[0])
  assert_close(value, r_value, "value", jnp.float32, 216, impl, scale=max(1.0, abs(float(r_value))))
  assert_close(dh, r_dh, "grad", jnp.float32, 216, f"{impl} dhidden")
  assert_close(dw, r_dw, "grad", jnp.float32, 28, f"{impl} dlm_head")


@pytest.mark.parametrize("impl,platform", PATHS)
@pytest.mark.parametrize("option", ["tis_token_dual_clip", "gspo_sequence_mask"])
def test_vocab_sharded_new_options_equal_unsharded(impl, platform, option):
  """Both gradient schedules (one pass; statistics then gradients) under shard_map, tp = 4."""
  args, kw = options_problem(2, 6, 32, 512, jnp.float32, option, seed=3)
  mesh = make_mesh(dp=1, fsdp=2, tp=4)
  sharded = _run(args, kw, impl, platform, mesh=mesh, vocab_axis="tp")  # chunk_size 4, 3 chunks
  plain = _run(args, kw, impl, platform)
  assert_close(sharded[0], plain[0], "value", jnp.float32, 544, impl, scale=abs(float(plain[0])))
  for name, a, e in zip(plain[1]._fields, sharded[1], plain[1]):
    if name == "is_clipped":
      np.testing.assert_array_equal(a, e, err_msg=impl)
    else:
      assert_close(
        a, e, "value", jnp.float32, 544, f"{impl} {name}", scale=max(1.0, np.abs(e).max())
      )
  assert_close(sharded[2][0], plain[2][0], "grad", jnp.float32, 544, f"{impl} dhidden")
  assert_close(sharded[2][1], plain[2][1], "grad", jnp.float32, 44, f"{impl} dlm_head")


@pytest.mark.parametrize("gap", [100.0, -100.0])
def test_stale_sampler_with_is_modes_finite_in_every_impl(gap):
  """old - s = +-100: rho overflows to inf (truncated to the cap) or underflows to 0."""
  args, kw = options_problem(2, 5, 16, 200, jnp.float32, "gspo_sequence_mask", seed=5)
  kw = dict(kw, sampler_logps=kw["old_logps"] - gap, is_mode="sequence_truncate", is_cap=2.0)
  r_value, _, (r_dh, r_dw) = reference(args, kw)
  for impl, platform in IMPLS:
    value, aux, (dh, dw) = _run(args, kw, impl, platform)
    for x in (value, dh, dw, *aux):
      assert np.isfinite(np.asarray(x, np.float32)).all(), impl
    w = np.asarray(aux.is_weight)[np.asarray(args[3])]
    np.testing.assert_array_equal(w, 2.0 if gap > 0 else 0.0, err_msg=impl)
    assert_close(
      value, r_value, "value", jnp.float32, 216, impl, scale=max(1.0, abs(float(r_value)))
    )
    assert_close(dh, r_dh, "grad", jnp.float32, 216, f"{impl} dhidden")
    assert_close(dw, r_dw, "grad", jnp.float32, 26, f"{impl} dlm_head")


# ------------------------------------------------------------------------------ tensor parallel
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("impl,platform", PATHS)
@pytest.mark.parametrize("offset", [0.0, 120.0])
def test_vocab_sharded_equals_unsharded(tp, impl, platform, offset):
  """offset 120: every logit ~120, so each shard's log-sum-exp is > 88 and exp(lse) overflows f32; the
  cross-shard combination must subtract the max first, as a plain log(sum(exp)) would give inf."""
  args, kw = make_problem(
    2, 6, 32, 512, jnp.float32, seed=tp, **dict(OPTIONS["off_policy_kl_temp"], temperature=0.9)
  )
  h, w = np.array(args[0]), np.array(args[1])
  h[..., 0], w[0] = 1.0, w[0] + offset  # logits = h @ w gain +offset on every column
  args = (jnp.asarray(h), jnp.asarray(w), *args[2:])
  if offset:  # old / ref log-probs near the new (shifted-logit) policy
    _, aux0 = kernels.fused_linear_grpo_loss(*args, impl="xla")
    rng = np.random.default_rng(tp)
    near = lambda: (
      aux0.per_token_logps + rng.normal(scale=0.25, size=h.shape[:2]).astype(np.float32)
    )
    kw = dict(kw, old_logps=near(), ref_logps=near())
  mesh = make_mesh(dp=1, fsdp=8 // tp, tp=tp)
  blocks = LinearBlocks(8, 128, 32) if impl == "pallas" else None
  call = dict(impl=impl, platform=platform, interpret=True, blocks=blocks, chunk_size=4)

  @jax.jit
  def sharded(h, w):
    return value_and_grads(
      kernels.fused_linear_grpo_loss, (h, w) + args[2:], kw, mesh=mesh, vocab_axis="tp", **call
    )

  value, aux, (dh, dw) = sharded(*args[:2])
  assert dw.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
  z = float(np.max(np.abs(np.asarray(h[..., 0:1] * w[0]))))  # the logits' magnitude
  # dh = dl @ w^T sums terms of size |dl| * |w| (~offset in column 0) to a cancelled result, dw = h^T dl
  # terms of size |h| * |dl|: their rounding is relative to those terms, not to the result.
  dl = np.abs(
    np.asarray(
      jax.grad(lambda x: kernels.grpo_loss(x, *args[2:], **kw, impl="xla")[0])(
        jnp.einsum("bth,hv->btv", args[0], args[1])
      )
    )
  ).reshape(-1, 512)
  # And p = exp(z - lse) carries lse's absolute rounding, |z| eps: |z| / 8 times the table's 8-eps
  # accumulation budget per term (1e-5 relative at z ~ 126, seen in dlm_head).
  amp = max(1.0, z / 8.0)
  dh_scale = float(np.max(dl.sum(-1))) * float(np.max(np.abs(w))) * amp
  dw_scale = float(np.max(np.abs(h.reshape(-1, 32)).T @ dl)) * amp
  for name, (r_value, r_aux, (r_dh, r_dw)) in (
    ("reference", reference(args, kw)),
    ("unsharded", value_and_grads(kernels.fused_linear_grpo_loss, args, kw, **call)),
  ):
    assert np.isfinite(float(value)), name
    scale = max(loss_scale(r_aux, args[3], args[4], kw), float(abs(r_value)))
    assert_close(value, r_value, "value", jnp.float32, 32 + 512, name, scale=scale)
    # logp and entropy are differences of ~offset-sized terms: they round relative to the logits
    for field in ("entropy", "per_token_logps"):
      a, e = getattr(aux, field), getattr(r_aux, field)
      assert_close(a, e, "value", jnp.float32, 32 + 512, f"{name} {field}", scale=max(z, 1.0))
    assert_close(dh, r_dh, "grad", jnp.float32, 32 + 512, f"{name} dhidden", scale=dh_scale)
    assert_close(dw, r_dw, "grad", jnp.float32, 12 + 32, f"{name} dlm_head", scale=dw_scale)


# ------------------------------------------------------------------- extreme and non-finite input
@pytest.mark.parametrize("impl,platform", IMPLS)
def test_aux_carries_no_gradient_in_any_impl(impl, platform):
  """Documented: aux is data. The xla path must agree with the fused ones (it autodiffs a reference
  whose aux would otherwise carry a gradient)."""
  args, kw = make_problem(2, 4, 16, 200, jnp.float32, seed=3, **OPTIONS["off_policy_kl_temp"])

  def f(h, w):
    aux = kernels.fused_linear_grpo_loss(
      h, w, *args[2:], **kw, impl=impl, platform=platform, interpret=True
    )[1]
    return jnp.sum(aux.per_token_logps) + jnp.sum(aux.per_token_kl) + jnp.sum(aux.entropy)

  for g in jax.grad(f, argnums=(0, 1))(*args[:2]):
    np.testing.assert_array_equal(g, 0.0)


def _run(args, kw, impl, platform, **call_kw):
  blocks = LinearBlocks(8, 128, 16) if impl == "pallas" else None
  return value_and_grads(
    kernels.fused_linear_grpo_loss,
    args,
    kw,
    impl=impl,
    platform=platform,
    interpret=True,
    blocks=blocks,
    chunk_size=4,
    **call_kw,
  )


@pytest.mark.parametrize("impl,platform", IMPLS)
def test_nonfinite_masked_rows_never_reach_loss_or_gradient(impl, platform):
  """NaN / inf hidden states, old and ref log-probs and junk ids at masked positions: loss, aux and
  both gradients exactly equal those of the clean problem, and dhidden is exactly 0 there."""
  args, kw = make_problem(3, 4, 16, 200, jnp.float32, seed=4, **OPTIONS["off_policy_kl_temp"])
  hidden, lm_head, ids, mask, adv = args
  masked = ~np.asarray(mask)
  assert masked.any()
  bad_h = np.array(hidden)
  bad_h[masked] = np.nan
  bad_h[np.nonzero(masked)[0][0], np.nonzero(masked)[1][0], :3] = np.inf
  poison = lambda a: jnp.where(jnp.asarray(masked), jnp.nan, a)
  bad_kw = dict(kw, old_logps=poison(kw["old_logps"]), ref_logps=poison(kw["ref_logps"]))
  bad = (jnp.asarray(bad_h), lm_head, jnp.where(jnp.asarray(masked), -100, ids), mask, adv)
  clean, dirty = _run(args, kw, impl, platform), _run(bad, bad_kw, impl, platform)
  for a, e in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean)):
    np.testing.assert_array_equal(a, e)
  np.testing.assert_array_equal(np.asarray(dirty[2][0])[masked], 0.0)


def test_stale_sampler_is_clamped_identically_in_every_impl():
  """old = logp - 100, ref = logp + 100: finite loss and gradients, every impl equal to the reference;
  and with the clamp inactive (max_log_ratio default vs None) the loss is bit for bit unchanged."""
  args, kw = make_problem(2, 5, 16, 200, jnp.float32, seed=5, **OPTIONS["off_policy_kl_temp"])
  logp = kernels.fused_linear_grpo_loss(*args, **kw, impl="xla")[1].per_token_logps
  stale = dict(kw, old_logps=logp - 100.0, ref_logps=logp + 100.0)
  r_value, _, (r_dh, r_dw) = reference(args, stale)
  for impl, platform in PATHS:
    value, aux, (dh, dw) = _run(args, stale, impl, platform)
    for x in (value, dh, dw, *aux):
      assert np.isfinite(np.asarray(x, np.float32)).all(), impl
    assert_close(value, r_value, "value", jnp.float32, 216, impl, scale=abs(float(r_value)))
    assert_close(dh, r_dh, "grad", jnp.float32, 216, f"{impl} dhidden")
    assert_close(dw, r_dw, "grad", jnp.float32, 26, f"{impl} dlm_head")
  for impl, platform in IMPLS:
    on, off = _run(args, kw, impl, platform), _run(args, kw, impl, platform, max_log_ratio=None)
    for a, e in zip(jax.tree.leaves(on[:2]), jax.tree.leaves(off[:2])):
      np.testing.assert_array_equal(a, e, err_msg=impl)


@pytest.mark.parametrize("impl,platform", IMPLS)
def test_unmasked_bad_ids_poison_under_jit(impl, platform):
  """Under jit the id check cannot run: an unmasked id above V or negative (never wrapped to V - 1)
  gives a NaN loss in every impl."""
  args, _kw = make_problem(2, 3, 16, 100, jnp.float32, seed=6)
  mask = jnp.ones((2, 3), bool)
  f = jax.jit(
    lambda i: kernels.fused_linear_grpo_loss(
      args[0], args[1], i, mask, args[4], impl=impl, platform=platform, interpret=True
    )[0]
  )
  assert np.isfinite(f(args[2]))
  for bad_id in (100, -1):
    assert np.isnan(f(args[2].at[1, 2].set(bad_id))), bad_id


# ----------------------------------------------------------------------------------------- memory
def _temp_bytes(impl, shape, **call_kw):
  s = shape
  specs = (
    jax.ShapeDtypeStruct((s.batch, s.seq, s.hidden), jnp.dtype(s.dtype)),
    jax.ShapeDtypeStruct((s.hidden, s.vocab), jnp.dtype(s.dtype)),
    jax.ShapeDtypeStruct((s.batch, s.seq), jnp.int32),
    jax.ShapeDtypeStruct((s.batch, s.seq), jnp.bool_),
    jax.ShapeDtypeStruct((s.batch,), jnp.float32),
  )

  def step(h, w, ids, mask, adv):
    return jax.value_and_grad(
      lambda h, w: kernels.fused_linear_grpo_loss(
        h, w, ids, mask, adv, impl=impl, interpret=True, **call_kw
      )[0],
      argnums=(0, 1),
    )(h, w)

  return jax.jit(step).trace(*specs).lower().compile().memory_analysis().temp_size_in_bytes


def test_pallas_temporaries_do_not_scale_with_tokens_times_vocab():
  shape = LINEAR_LOSS_SHAPES["cpu-mid"]  # N = 2048, V = 16000: an f32 [N, V] array is 131 MB
  xla, fused = _temp_bytes("xla", shape), _temp_bytes("pallas", shape)
  assert fused < xla / 8, f"pallas temporaries {fused} B vs XLA reference {xla} B"
  # Doubling the tokens grows the temporaries by far less than one more f32 [N, V] would take.
  doubled = dataclasses.replace(shape, batch=2 * shape.batch)
  growth = _temp_bytes("pallas", doubled) - fused
  assert growth < shape.tokens * shape.vocab * 4 / 8, f"temporaries grew {growth} B with N"
  # The chunked path holds one [chunk, V] f32 buffer, whatever N.
  chunked = _temp_bytes("chunked", shape, chunk_size=256)
  assert (
    _temp_bytes("chunked", doubled, chunk_size=256) - chunked < shape.tokens * shape.vocab * 4 / 8
  )


# ------------------------------------------------------------------------------------- loss_scale
def scaled_value_and_grads(args, kw, s, fold: bool, **call):
  """Loss and (dhidden, dlm_head) of ``loss * s``: s passed as loss_scale (fold) or multiplied onto
  the returned loss (the cotangent). s is traced (jit argument), as a loop's micro-batch share."""

  def f(h, w, s_):
    loss = kernels.fused_linear_grpo_loss(
      h, w, *args[2:], **kw, loss_scale=s_ if fold else None, interpret=True, **call
    )[0]
    return loss if fold else loss * s_

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args[:2], s)


@pytest.mark.parametrize("impl,platform", IMPLS)
@pytest.mark.parametrize("option", ["off_policy_kl_temp", "gspo_sequence_mask"])
def test_loss_scale_equals_scaled_cotangent(impl, platform, option):
  """loss_scale=s gives the loss and both gradients of ``loss * s`` (the loop's micro-batch
  scaling), in every impl, on the one-pass token-level path and the sequence-level two-pass one
  (g from the [B, T] objective). Catches a scale that reaches the loss but not the in-forward
  gradients (grads 1/s too large), one applied twice (in the weights and again in the value the
  cotangent multiplies), or one lost on the path where g is formed outside the chunk loop."""
  if option in OPTIONS:
    args, kw = make_problem(2, 5, 32, 300, jnp.bfloat16, seed=5, **OPTIONS[option])
  else:
    args, kw = options_problem(2, 5, 32, 300, jnp.bfloat16, option, seed=5)
  call = dict(impl=impl, platform=platform, chunk_size=4)
  if impl == "pallas":
    call["blocks"] = LinearBlocks(8, 128, 16)
  s = jnp.float32(0.375)
  v_fold, (dh_fold, dw_fold) = scaled_value_and_grads(args, kw, s, True, **call)
  v_ct, (dh_ct, dw_ct) = scaled_value_and_grads(args, kw, s, False, **call)
  np.testing.assert_allclose(v_fold, v_ct, rtol=1e-6, err_msg=f"{impl} value")
  hd, v, n = 32, 300, 10
  assert_close(dh_fold, dh_ct, "grad", jnp.bfloat16, hd + v, err_msg=f"{impl} dhidden")
  assert_close(dw_fold, dw_ct, "grad", jnp.bfloat16, n + hd, err_msg=f"{impl} dlm_head")
  # the scale is not a no-op here: the unscaled gradient is 1/s times larger
  _, (dh_one, _) = scaled_value_and_grads(args, kw, jnp.float32(1.0), True, **call)
  np.testing.assert_allclose(
    np.asarray(dh_one, np.float32) * 0.375, np.asarray(dh_fold, np.float32), rtol=2e-2, atol=1e-3
  )


def test_loss_scale_leaves_no_pass_over_the_lm_head_gradient():
  """With loss_scale the backward's cotangent is the constant 1, so XLA folds ``ct * dlm_head`` away:
  the compiled gradient has no multiply producing a [H, V] array, while ``loss * s`` keeps one. Catches
  a loss_scale applied in the backward (a traced multiply over [H, V], the pass the fold saves)."""
  args, kw = make_problem(2, 4, 32, 300, jnp.float32, seed=6)

  def multiplies(fold):
    def f(h, w, s_):
      loss = kernels.fused_linear_grpo_loss(
        h, w, *args[2:], **kw, loss_scale=s_ if fold else None, impl="chunked", chunk_size=4
      )[0]
      return loss if fold else loss * s_

    hlo = jax.jit(jax.grad(f, argnums=1)).lower(*args[:2], jnp.float32(0.5)).compile().as_text()
    return len(re.findall(r"= f32\[32,300\]\S* multiply\(", hlo))

  assert multiplies(False) >= 1  # the check sees the cotangent's pass when it is there
  assert multiplies(True) == 0


@pytest.mark.parametrize(
  "value,error",
  [(jnp.ones(2), TypeError), (float("nan"), ValueError), ("x", TypeError)],
)
def test_bad_loss_scale_raises_naming_it(value, error):
  args, kw = make_problem(1, 2, 16, 100, jnp.float32)
  with pytest.raises(error, match="loss_scale"):
    kernels.fused_linear_grpo_loss(*args, **kw, loss_scale=value, impl="chunked")


# ------------------------------------------------------------------------------ tuned impl="auto"
GPU_REAL = backend.make_target("gpu", interpret=False)
PROD = shape_key(16384, 2048, 151936, jnp.bfloat16)
TUNED_MOSAIC = MosaicLinearBlocks(64, 256, 64, 3, 4, 4096)


def _entry(winner_impl, winner_blocks, *rows):
  """A cache entry as bench.tune writes it: the winner and (impl, blocks, time_s, ok) rows."""
  cands = [dict(impl=i, blocks=autotune.blocks_to_json(b), time_s=t, ok=ok) for i, b, t, ok in rows]
  winner = dict(impl=winner_impl, blocks=autotune.blocks_to_json(winner_blocks))
  return dict(shape=PROD, winner=winner, candidates=cands)


def _from_entry(impl, blocks, chunk, entry, target=GPU_REAL, shape=PROD):
  """The call's (impl, blocks, chunk_size) when the cache holds ``entry`` for it."""
  legal = FUSED_OP.check_tuned(target, shape)
  resolve = lambda i, tiles: autotune.apply_checked(FUSED_OP, i, tiles, entry, legal)
  return fused_linear._choose(impl, blocks, chunk, resolve)


def test_tuned_entry_changes_the_chosen_impl_and_tiles():
  """impl="auto" takes the cache's winner with its tiles (Mosaic blocks; the chunked path's chunk
  size), an explicit impl its fastest passing tiles, given tiles keep the heuristic's impl. Catches
  a cache that is written by bench.tune but never read by the op (the tuned run would measure the
  heuristic), or ChunkBlocks passed on as ``blocks`` instead of ``chunk_size``."""
  rows = (
    ("chunked", ChunkBlocks(2048), 0.030, True),
    ("chunked", ChunkBlocks(512), 0.020, False),  # fastest, failed parity
    ("mosaic_gpu", TUNED_MOSAIC, 0.025, True),
  )
  mosaic = _entry("mosaic_gpu", TUNED_MOSAIC, *rows)
  pick = lambda impl, entry, blocks=None, chunk=None: _from_entry(impl, blocks, chunk, entry)
  assert pick("auto", mosaic) == ("mosaic_gpu", TUNED_MOSAIC, None)
  assert pick("auto", _entry("chunked", ChunkBlocks(1024))) == ("chunked", None, 1024)
  assert pick("chunked", mosaic) == ("chunked", None, 2048)  # fastest *passing*
  assert pick("auto", mosaic, chunk=256) == ("auto", None, 256)  # given tiles stay
  assert pick("auto", None) == ("auto", None, None)  # no entry: the heuristic


@pytest.mark.parametrize(
  "entry,why",
  [
    (_entry("mosaic_gpu", MosaicLinearBlocks(128, 128, 128, 4, 1, 8192)), "shared memory"),
    (_entry("triton", None), "tuned impl must be one of"),
    (dict(winner=dict(impl="mosaic_gpu", blocks=dict(block_n=64, tile=3))), "TypeError"),
    (dict(winner=dict(impl="mosaic_gpu", blocks=dict(block_n=96))), "multiple of 64"),
    (_entry("xla", ChunkBlocks(64)), "KeyError"),  # xla has no tiles
    (dict(winner="chunked"), "TypeError"),
  ],
)
def test_malformed_or_illegal_tuned_entry_falls_back_to_the_heuristic(entry, why):
  """A stale or hand-edited cache (fields that no longer exist, an impl that is gone, tiles over
  the shared-memory budget) must cost speed, not crash the op or run an illegal kernel: the
  caller's arguments come back, with a warning naming the problem."""
  with pytest.warns(UserWarning, match="heuristic runs instead") as record:
    choice = _from_entry("auto", None, None, entry)
  assert choice == ("auto", None, None)
  assert re.search(why, str(record[0].message)), record[0].message


def test_tuned_cache_file_is_read_and_a_corrupt_one_ignored(tmp_path):
  """Through kernels.autotune's per-device cache file: the entry bench.tune wrote for this device
  kind becomes the call's choice; an interpreted or foreign-platform target never reads it (the CPU
  host keeps impl="auto" = xla whatever the file says); a corrupt file (truncated JSON) falls back
  to the heuristic with a warning instead of failing every call."""
  shape = shape_key(16, 64, 256, jnp.bfloat16)
  path = autotune.cache_path(autotune.device_kind(), tmp_path)
  blocks = MosaicLinearBlocks(64, 128, 64, 2, 1, 256)
  data = dict(schema=autotune.SCHEMA, entries={"fused_linear": {}})
  data["entries"]["fused_linear"][FUSED_OP.bucket(shape)] = dict(
    winner=dict(impl="mosaic_gpu", blocks=autotune.blocks_to_json(blocks)), candidates=[]
  )
  path.write_text(json.dumps(data))
  legal = FUSED_OP.check_tuned(GPU_REAL, shape)
  this_device = lambda i, tiles: autotune.from_cache(FUSED_OP, i, tiles, shape, legal)
  on = lambda target: lambda i, tiles: autotune.resolve(FUSED_OP, i, tiles, target, shape)
  given = ("auto", None, None)
  with autotune.use_cache_dir(tmp_path):
    assert fused_linear._choose("auto", None, None, this_device) == ("mosaic_gpu", blocks, None)
    interp = backend.make_target("gpu", interpret=True)
    assert fused_linear._choose("auto", None, None, on(interp)) == given
    if backend.host_platform() != "gpu":
      assert fused_linear._choose("auto", None, None, on(GPU_REAL)) == given
  path.write_text(json.dumps(data)[:40])
  # entering clears the memoised read
  with autotune.use_cache_dir(tmp_path), pytest.warns(UserWarning, match="ignoring the tuning"):
    assert fused_linear._choose("auto", None, None, this_device) == given


# ----------------------------------------------------------------------------------------- errors
def test_bad_input_raises_clearly():
  args, _ = make_problem(2, 3, 16, 100, jnp.float32)
  h, w = args[:2]
  with pytest.raises(ValueError, match="hidden size mismatch"):
    kernels.fused_linear_grpo_loss(h, w.T, *args[2:])
  with pytest.raises(ValueError, match="same dtype"):
    kernels.fused_linear_grpo_loss(h, w.astype(jnp.bfloat16), *args[2:])
  with pytest.raises(ValueError, match="impl"):
    kernels.fused_linear_grpo_loss(*args, impl="triton")
  with pytest.raises(ValueError, match="bfloat16 / float16"):  # wgmma's f32 is tf32
    kernels.fused_linear_grpo_loss(*args, impl="mosaic_gpu", platform="gpu", interpret=True)
  with pytest.raises(ValueError, match="together"):
    kernels.fused_linear_grpo_loss(*args, vocab_axis="tp")
  with pytest.raises(ValueError, match="divisible"):
    kernels.fused_linear_grpo_loss(
      *args, impl="chunked", mesh=make_mesh(fsdp=1, tp=8), vocab_axis="tp"
    )
  with pytest.raises(ValueError, match="outside"):
    kernels.fused_linear_grpo_loss(h, w, args[2].at[0, 0].set(100), jnp.ones((2, 3), bool), args[4])
  with pytest.raises(ValueError, match="block_h"):
    kernels.fused_linear_grpo_loss(
      *args, impl="pallas", interpret=True, blocks=LinearBlocks(8, 128, 12)
    )
  with pytest.raises(TypeError, match="hidden must have a floating dtype"):
    kernels.fused_linear_grpo_loss(h.astype(jnp.int32), w.astype(jnp.int32), *args[2:])
  with pytest.raises(ValueError, match="chunk_size must be a positive int"):
    kernels.fused_linear_grpo_loss(*args, impl="chunked", chunk_size=0)


# the loss arguments go through grpo_loss's one check (tested in full in test_grpo_loss.py): a few
# here, per impl, show that the fused op reaches it before anything compiles
@pytest.mark.parametrize("impl,platform", IMPLS)
@pytest.mark.parametrize(
  "bad,match",
  [
    (dict(advantages=[1.0, float("nan")]), "advantages has 1 NaN"),
    (dict(beta=-0.5), r"beta must be finite and in \[0, inf\)"),
    (dict(epsilon_low=1.0), r"epsilon_low must be finite and in \[0, 1\)"),
    (dict(temperature=float("nan")), "temperature must be finite"),
    (dict(loss_type="dapo", num_items_in_batch=0), "num_items_in_batch"),
    (dict(max_log_ratio=-1.0), "max_log_ratio"),
    (dict(is_mode="token_mask"), "is_mode='token_mask' needs sampler_logps"),
    (dict(epsilon_c=1.0), r"epsilon_c must be finite and in \(1, inf\)"),
    (dict(is_cap=0.0), r"is_cap must be finite and in \(0, inf\)"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level must be one of"),
    (dict(sampler_logps=jnp.zeros((2,))), "sampler_logps must have shape"),
    (
      dict(sampler_logps=jnp.full((2, 3), jnp.nan)),
      r"sampler_logps has \d+ NaN or inf values at unmasked",
    ),
    (dict(advantages=jnp.zeros((2, 4))), "advantages must have shape"),
    (dict(spec=kernels.LossSpec(beta=0.0), beta=0.5), "conflicts with spec.beta"),
  ],
)
def test_loss_arguments_checked_in_every_impl(impl, platform, bad, match):
  args, _ = make_problem(2, 3, 16, 100, jnp.float32)
  kw = dict(bad)
  adv = kw.pop("advantages", args[4])
  with pytest.raises(ValueError, match=match):
    kernels.fused_linear_grpo_loss(
      *args[:4], adv, **kw, impl=impl, platform=platform, interpret=True
    )


@pytest.mark.parametrize("impl,platform", IMPLS)
def test_python_list_advantages_in_every_impl(impl, platform):
  args, _kw = make_problem(2, 3, 16, 100, jnp.float32, seed=2)
  call = dict(impl=impl, platform=platform, interpret=True)
  as_array = kernels.fused_linear_grpo_loss(*args, **call)[0]
  as_list = kernels.fused_linear_grpo_loss(*args[:4], np.asarray(args[4]).tolist(), **call)[0]
  np.testing.assert_array_equal(as_list, as_array)


def test_no_recompile_across_calls():
  # Counted as traces (a retrace is what a recompile costs first), as in test_grpo_loss.py: the C++
  # cache size read 0 in a full-file run after other tests had run, so it is not a property of `step`.
  args, _kw = make_problem(2, 4, 16, 200, jnp.float32, off_policy=True)
  traces = []

  def step(h, w, old):
    traces.append(h.shape)
    return jax.grad(
      lambda h, w: kernels.fused_linear_grpo_loss(
        h, w, *args[2:], old_logps=old, impl="chunked", interpret=True
      )[0],
      argnums=(0, 1),
    )(h, w)

  step = jax.jit(step)
  for seed in range(3):
    fresh, fresh_kw = make_problem(2, 4, 16, 200, jnp.float32, off_policy=True, seed=seed)
    jax.block_until_ready(step(fresh[0], fresh[1], fresh_kw["old_logps"]))
  assert len(traces) == 1
