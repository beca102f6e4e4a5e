"""Parity of the Pallas GRPO loss (both kernel families, in the interpreter) against the reference."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import kernels
from bench.tolerances import assert_close
from kernels.grpo_loss import LossBlocks
from kernels.grpo_loss.reference import LOSS_TYPES, token_logps_and_entropy
from tests.problems import loss_scale, policy_kwargs

# (platform, blocks maker): the tiled family as the CPU interpreter runs it, and the GPU rowloop family
# run through the interpreter, so the Triton kernel's arithmetic is checked without a GPU.
FAMILIES = {
  "tiled": ("cpu", lambda bn, bv: LossBlocks(bn, bv)),
  "rowloop": ("gpu", lambda bn, bv: LossBlocks(1, 1 << max(bv - 1, 1).bit_length())),
}
OPTIONS = {
  "on_policy": dict(),
  "off_policy_temp": dict(off_policy=True, temperature=0.7, epsilon_high=0.28),
  "kl": dict(off_policy=True, beta=0.04, temperature=1.3),
}


def make_problem(
  b, t, v, dtype, *, off_policy=False, beta=0.0, seed=None, empty_row=True, **options
):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(b, t, v)) * 2.0, dtype)
  ids = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  mask = rng.random((b, t)) < 0.75
  if empty_row:
    mask[rng.integers(b)] = False
  logp, _ = token_logps_and_entropy(logits, ids, options.get("temperature", 1.0))
  kw = policy_kwargs(rng, logp, options, off_policy=off_policy, beta=beta)
  return (logits, ids, jnp.asarray(mask), jnp.asarray(rng.normal(size=b), jnp.float32)), kw


def loss_and_grad(args, kw, **call_kw):
  def f(x):
    return kernels.grpo_loss(x, *args[1:], **kw, **call_kw)

  (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(args[0])
  return loss, aux, grad


def assert_parity(args, kw, *, platform, blocks, loss_types=LOSS_TYPES):
  v = args[0].shape[-1]
  for loss_type in loss_types:
    ours = loss_and_grad(
      args, kw, loss_type=loss_type, impl="pallas", platform=platform, interpret=True, blocks=blocks
    )
    ref = loss_and_grad(args, kw, loss_type=loss_type, impl="xla")
    msg = f"{loss_type} {platform} {blocks}"
    scale = max(loss_scale(ref[1], args[2], args[3], kw), float(abs(ref[0])))
    assert_close(ours[0], ref[0], "value", jnp.float32, v, msg, scale=scale)
    for name, a, e in zip(ours[1]._fields, ours[1], ref[1]):
      if name == "is_clipped":
        np.testing.assert_array_equal(a, e, err_msg=msg)
      else:
        assert_close(a, e, "value", jnp.float32, v, f"{msg} {name}")
    assert ours[2].dtype == args[0].dtype
    assert_close(ours[2], ref[2], "grad", args[0].dtype, v, f"{msg} dlogits")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
def test_parity_every_loss_type(family, dtype, option):
  platform, blocks = FAMILIES[family]
  args, kw = make_problem(3, 5, 300, dtype, **OPTIONS[option])
  assert_parity(args, kw, platform=platform, blocks=blocks(8, 128))


@given(
  b=st.integers(1, 4),
  t=st.integers(1, 9),
  v=st.integers(1, 700),
  bn=st.integers(1, 16),
  bv=st.integers(1, 300),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  family=st.sampled_from(sorted(FAMILIES)),
  option=st.sampled_from(sorted(OPTIONS)),
  loss_type=st.sampled_from(LOSS_TYPES),
)
def test_parity_ragged_shapes(b, t, v, bn, bv, dtype, family, option, loss_type):
  platform, blocks = FAMILIES[family]
  args, kw = make_problem(b, t, v, dtype, **OPTIONS[option])
  assert_parity(args, kw, platform=platform, blocks=blocks(bn, bv), loss_types=(loss_type,))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vocab", [151936, 128256])
def test_parity_production_vocab(family, vocab):
  """Qwen and Llama-3 vocabularies with the default blocks: the masked vocab tail at full width."""
  platform, _ = FAMILIES[family]
  args, kw = make_problem(1, 3, vocab, jnp.bfloat16, off_policy=True, beta=0.04, empty_row=False)
  assert_parity(args, kw, platform=platform, blocks=None, loss_types=("grpo",))


def test_reuse_logits_buffer_same_gradient():
  args, kw = make_problem(2, 4, 200, jnp.float32)
  call = dict(impl="pallas", platform="cpu", blocks=LossBlocks(8, 128))
  a = loss_and_grad(args, kw, **call)
  b = loss_and_grad(args, kw, reuse_logits_buffer=True, **call)
  np.testing.assert_array_equal(a[2], b[2])


def test_masked_positions_ignore_invalid_ids_and_unmasked_ones_poison_under_jit():
  args, _kw = make_problem(2, 4, 50, jnp.float32, empty_row=False)
  logits, ids, mask, adv = args
  mask = mask.at[0, 0].set(False)
  padded = ids.at[0, 0].set(-100)
  for impl in ("pallas", "xla"):
    call = functools.partial(kernels.grpo_loss, impl=impl, platform="cpu")
    np.testing.assert_allclose(
      call(logits, padded, mask, adv)[0], call(logits, ids, mask, adv)[0], rtol=1e-6
    )
    # jit hides the values from the argument check: an unmasked bad id must surface as NaN, not a number
    bad = ids.at[1, 0].set(50)
    loss = jax.jit(lambda i: call(logits, i, mask.at[1, 0].set(True), adv)[0])(bad)  # noqa: B023
    assert np.isnan(loss), impl


def test_jit_does_not_recompile_for_new_values():
  f = jax.jit(lambda x, i, m, a: kernels.grpo_loss(x, i, m, a, impl="pallas", platform="cpu")[0])
  for seed in range(3):
    args, _ = make_problem(2, 3, 40, jnp.float32, seed=seed)
    f(*args)
  assert f._cache_size() == 1


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(logits=jnp.zeros((2, 3))), r"logits must be \[B, T, V\]"),
    (dict(logits=jnp.zeros((2, 3, 5), jnp.int32)), "floating point"),
    (dict(completion_ids=jnp.zeros((2, 4), jnp.int32)), "completion_ids must have shape"),
    (dict(completion_ids=jnp.zeros((2, 3))), "must be integers"),
    (dict(completion_ids=jnp.full((2, 3), 5)), r"outside \[0, 5\)"),
    (dict(completion_mask=jnp.ones((3, 2))), "completion_mask must have shape"),
    (dict(advantages=jnp.ones((3,))), "advantages must have shape"),
    (dict(old_logps=jnp.ones((2,))), "old_logps must have shape"),
    (dict(beta=0.1), "ref_logps is required"),
    (dict(loss_type="ppo"), "unknown loss_type"),
    (dict(temperature=0.0), "temperature must be positive"),
    (dict(temperature=-1.0), "temperature must be positive"),
    (dict(epsilon_low=-0.1), "epsilons must be >= 0"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(max_completion_length=0), "max_completion_length"),
  ],
)
def test_bad_input_raises_value_error(kwargs, match):
  args = dict(
    logits=jnp.zeros((2, 3, 5)),
    completion_ids=jnp.zeros((2, 3), jnp.int32),
    completion_mask=jnp.ones((2, 3)),
    advantages=jnp.ones((2,)),
  )
  args.update(kwargs)
  positional = [args.pop(k) for k in ("logits", "completion_ids", "completion_mask", "advantages")]
  with pytest.raises(ValueError, match=match):
    kernels.grpo_loss(*positional, **args)


def test_illegal_blocks_rejected_before_lowering():
  args, _kw = make_problem(2, 8, 1000, jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 128"):
    kernels.grpo_loss(*args, platform="tpu", blocks=LossBlocks(16, 100))
  with pytest.raises(ValueError, match="powers of two"):
    kernels.grpo_loss(*args, platform="gpu", blocks=LossBlocks(1, 100))
  with pytest.raises(ValueError, match="block_n must be 1"):
    kernels.grpo_loss(*args, platform="gpu", blocks=LossBlocks(4, 128))
  with pytest.raises(ValueError, match="positive int"):
    LossBlocks(0, 128)
