"""Ahead-of-time lowering of the real kernels (Mosaic TPU, Triton CUDA) from this CPU host.

Lowering runs the whole Pallas -> Mosaic / Triton-IR path, which is where TPU-illegal block shapes
(the (8, 128) rule) and Triton's power-of-two rule are rejected; no accelerator is needed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import kernels
from bench.shapes import LINEAR_LOSS_SHAPES, LOSS_SHAPES, PAGED_SHAPES, PRODUCTION_LOSS_SHAPES
from kernels import backend
from kernels.grpo_loss import LossBlocks


def lower_loss(
  platform, shape, *, grad: bool, blocks=None, off_policy=True, beta=0.04, impl="pallas", **options
):
  b, t, v = shape.batch, shape.seq, shape.vocab
  specs = [
    jax.ShapeDtypeStruct((b, t, v), jnp.dtype(shape.dtype)),
    jax.ShapeDtypeStruct((b, t), jnp.int32),
    jax.ShapeDtypeStruct((b, t), jnp.bool_),
    jax.ShapeDtypeStruct((b,), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.float32),
  ]

  def loss(logits, ids, mask, adv, old, ref, sampler):
    return kernels.grpo_loss(
      logits,
      ids,
      mask,
      adv,
      old_logps=old if off_policy else None,
      ref_logps=ref,
      sampler_logps=sampler if options.get("is_mode") else None,
      beta=beta,
      impl=impl,
      blocks=blocks,
      **options,
    )[0]

  fn = jax.grad(loss) if grad else loss
  target = backend.make_target(platform, interpret=False)
  with backend.use_target(platform, interpret=False):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=(target.lowering_platform,)).as_text()


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("shape_name", PRODUCTION_LOSS_SHAPES)
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_lowers_real_kernel_at_production_shape(platform, shape_name, grad):
  text = lower_loss(platform, LOSS_SHAPES[shape_name], grad=grad)
  marker = backend.LOWERED_KERNEL_MARKERS[platform]
  # the statistics kernel; differentiated (the training path), the one kernel that also writes dlogits
  assert text.count(marker) == 1, f"expected the {platform} kernel, not the interpreter"


@pytest.mark.parametrize("shape_name", PRODUCTION_LOSS_SHAPES)
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_mosaic_gpu_loss_lowers_at_production_shape(shape_name, grad):
  """The Mosaic GPU kernels (impl="mosaic_gpu") lower for sm_90: the WGMMA register layouts, the
  swizzled TMA tiles and the pipelines are checked here, which the interpreter cannot do."""
  text = lower_loss("gpu", LOSS_SHAPES[shape_name], grad=grad, impl="mosaic_gpu")
  assert text.count(backend.MOSAIC_GPU_MARKER) == 1  # statistics, or the training kernel
  assert backend.LOWERED_KERNEL_MARKERS["gpu"] not in text  # no Triton kernel on this path


# The sequence-level options (importance weights per sequence, GSPO ratio) and the dual clip: the
# per-sequence sums are [B, T] XLA math around the same two kernels.
SPEC_OPTIONS = dict(
  is_mode="sequence_truncate", importance_sampling_level="sequence", epsilon_c=3.0, is_cap=2.0
)


@pytest.mark.parametrize(
  "platform,impl", [("tpu", "pallas"), ("gpu", "pallas"), ("gpu", "mosaic_gpu")]
)
@pytest.mark.parametrize("shape_name", PRODUCTION_LOSS_SHAPES)
def test_loss_spec_options_lower_at_production_shape(platform, impl, shape_name):
  text = lower_loss(platform, LOSS_SHAPES[shape_name], grad=True, impl=impl, **SPEC_OPTIONS)
  marker = backend.MOSAIC_GPU_MARKER if impl == "mosaic_gpu" else None
  assert text.count(marker or backend.LOWERED_KERNEL_MARKERS[platform]) == 2


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_on_policy_lowers(platform):
  text = lower_loss(platform, LOSS_SHAPES["qwen2.5-8k"], grad=True, off_policy=False, beta=0.0)
  assert text.count(backend.LOWERED_KERNEL_MARKERS[platform]) == 1  # the training kernel


# The two-pass training path's other branch: a caller differentiating an aux output gets the training
# kernel and the three-pass backward kernel; token-level options lower into the in-kernel coefficient.
@pytest.mark.parametrize(
  "platform,impl", [("tpu", "pallas"), ("gpu", "pallas"), ("gpu", "mosaic_gpu")]
)
@pytest.mark.parametrize("shape_name", PRODUCTION_LOSS_SHAPES)
def test_aux_gradient_and_token_options_lower_at_production_shape(platform, impl, shape_name):
  shape = LOSS_SHAPES[shape_name]
  marker = backend.MOSAIC_GPU_MARKER if impl == "mosaic_gpu" else None
  marker = marker or backend.LOWERED_KERNEL_MARKERS[platform]
  options = dict(is_mode="token_mask", epsilon_c=3.0, temperature=0.7)
  assert lower_loss(platform, shape, grad=True, impl=impl, **options).count(marker) == 1
  b, t, v = shape.batch, shape.seq, shape.vocab
  x = jax.ShapeDtypeStruct((b, t, v), jnp.dtype(shape.dtype))
  ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
  mask = jax.ShapeDtypeStruct((b, t), jnp.bool_)
  adv = jax.ShapeDtypeStruct((b,), jnp.float32)
  ref = jax.ShapeDtypeStruct((b, t), jnp.float32)

  def loss(logits, ids, mask, adv, ref):
    out = kernels.grpo_loss(logits, ids, mask, adv, ref_logps=ref, beta=0.04, impl=impl)
    return out[0] + jnp.sum(out[1].per_token_kl)

  target = backend.make_target(platform, interpret=False)
  with backend.use_target(platform, interpret=False):
    traced = jax.jit(jax.grad(loss)).trace(x, ids, mask, adv, ref)
    text = traced.lower(lowering_platforms=(target.lowering_platform,)).as_text()
  assert text.count(marker) == 2  # the training kernel + the backward kernel


@pytest.mark.parametrize("shape_name", PRODUCTION_LOSS_SHAPES)
def test_split_row_statistics_lower_for_triton(shape_name):
  """LossBlocks.splits > 1: the statistics kernel's (row, split) grid with a traced chunk count per
  split lowers for CUDA (forward, and GSPO's statistics + backward kernels)."""
  blocks = LossBlocks(1, 8192, num_warps=16, num_stages=2, splits=4)
  shape = LOSS_SHAPES[shape_name]
  marker = backend.LOWERED_KERNEL_MARKERS["gpu"]
  assert lower_loss("gpu", shape, grad=False, blocks=blocks).count(marker) == 1
  assert lower_loss("gpu", shape, grad=True, blocks=blocks, **SPEC_OPTIONS).count(marker) == 2


def test_mosaic_itself_rejects_what_our_check_rejects():
  """Our block check mirrors Mosaic's rule: with the check satisfied-by-fiat (N = bn), Mosaic accepts;
  a 100-wide vocab tile is rejected by our check before Mosaic sees it."""
  shape = LOSS_SHAPES["qwen2.5-8k"]
  with pytest.raises(ValueError, match="multiple of 128"):
    lower_loss("tpu", shape, grad=False, blocks=LossBlocks(128, 100))
  assert "tpu_custom_call" in lower_loss("tpu", shape, grad=False, blocks=LossBlocks(8, 1024))


def lower_fused_linear(platform, shape, impl, *, grad: bool, **options):
  b, t, hd, v = shape.batch, shape.seq, shape.hidden, shape.vocab
  dtype = jnp.dtype(shape.dtype)
  specs = [
    jax.ShapeDtypeStruct((b, t, hd), dtype),
    jax.ShapeDtypeStruct((hd, v), dtype),
    jax.ShapeDtypeStruct((b, t), jnp.int32),
    jax.ShapeDtypeStruct((b, t), jnp.bool_),
    jax.ShapeDtypeStruct((b,), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.float32),
    jax.ShapeDtypeStruct((b, t), jnp.float32),
  ]

  def loss(h, w, ids, mask, adv, old, sampler):
    s = sampler if options.get("is_mode") else None
    return kernels.fused_linear_grpo_loss(
      h, w, ids, mask, adv, old_logps=old, sampler_logps=s, impl=impl, **options
    )[0]

  fn = jax.value_and_grad(loss, argnums=(0, 1)) if grad else loss
  target = backend.make_target(platform, interpret=False)
  with backend.use_target(platform, interpret=False):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=(target.lowering_platform,)).as_text()


@pytest.mark.parametrize(
  "platform,impl,grad_kernels", [("tpu", "pallas", 3), ("tpu", "chunked", 2), ("gpu", "chunked", 2)]
)
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_fused_linear_lowers_at_production_shape(platform, impl, grad_kernels, grad):
  """N = 8192, H = 2048, V = 151936 (Qwen2.5-3B's head). The loss alone runs only the statistics
  kernel; differentiated, the gradient kernels too (pallas: dhidden + dweight; chunked: softmax grad)."""
  text = lower_fused_linear(platform, LINEAR_LOSS_SHAPES["qwen2.5-3b-8k"], impl, grad=grad)
  assert text.count(backend.LOWERED_KERNEL_MARKERS[platform]) == (grad_kernels if grad else 1)


@pytest.mark.parametrize(
  "platform,impl,grad_kernels", [("tpu", "pallas", 3), ("tpu", "chunked", 2), ("gpu", "chunked", 2)]
)
def test_fused_linear_spec_options_lower_at_production_shape(platform, impl, grad_kernels):
  """Sequence-level options: the chunked path runs its statistics kernel in a first pass and the
  softmax-gradient kernel in a second one (recomputing the logits), the same kernels as in one pass."""
  shape = LINEAR_LOSS_SHAPES["qwen2.5-3b-8k"]
  text = lower_fused_linear(platform, shape, impl, grad=True, **SPEC_OPTIONS)
  assert text.count(backend.LOWERED_KERNEL_MARKERS[platform]) == grad_kernels


@pytest.mark.parametrize(
  "platform,impl", [("tpu", "pallas"), ("gpu", "pallas"), ("gpu", "mosaic_gpu")]
)
@pytest.mark.parametrize("shape_name", ["decode-4k", "decode-16k-b8"])
def test_paged_attention_lowers_at_production_shape(platform, impl, shape_name):
  """B = 64, Hq = 16, Hkv = 2, D = 128, ctx = 4096 (and a long-context batch) with the default blocks:
  one kernel call; the GPU ones with split-K (its log-sum-exp merge is plain XLA). The Mosaic GPU
  kernel's wgmma with a transposed K operand is checked only here and on a GPU (interpreter gap)."""
  s = PAGED_SHAPES[shape_name]
  dtype = jnp.dtype(s.dtype)
  pool = s.batch * s.pages_per_seq
  specs = [
    jax.ShapeDtypeStruct((s.batch, s.q_heads, s.head_dim), dtype),
    jax.ShapeDtypeStruct((s.kv_heads, pool, s.page_size, s.head_dim), dtype),
    jax.ShapeDtypeStruct((s.kv_heads, pool, s.page_size, s.head_dim), dtype),
    jax.ShapeDtypeStruct((s.batch,), jnp.int32),
    jax.ShapeDtypeStruct((s.batch, s.pages_per_seq), jnp.int32),
  ]
  target = backend.make_target(platform, interpret=False)
  fn = lambda *a: kernels.paged_attention(*a, impl=impl, platform=platform, interpret=False)
  with backend.use_target(platform, interpret=False):  # jax 0.11 + GPU: the abstract H100
    text = jax.jit(fn).trace(*specs).lower(lowering_platforms=(target.lowering_platform,)).as_text()
  marker = backend.MOSAIC_GPU_MARKER if impl == "mosaic_gpu" else None
  assert text.count(marker or backend.LOWERED_KERNEL_MARKERS[platform]) == 1


def _lower_paged(shape_name, impl, blocks):
  s = PAGED_SHAPES[shape_name]
  dtype = jnp.dtype(s.dtype)
  pool = s.batch * s.pages_per_seq
  kv = jax.ShapeDtypeStruct((s.kv_heads, pool, s.page_size, s.head_dim), dtype)
  specs = [
    jax.ShapeDtypeStruct((s.batch, s.q_heads, s.head_dim), dtype),
    kv,
    kv,
    jax.ShapeDtypeStruct((s.batch,), jnp.int32),
    jax.ShapeDtypeStruct((s.batch, s.pages_per_seq), jnp.int32),
  ]
  target = backend.make_target("gpu", interpret=False)
  fn = lambda *a: kernels.paged_attention(
    *a, impl=impl, platform="gpu", interpret=False, blocks=blocks
  )
  with backend.use_target("gpu", interpret=False):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=(target.lowering_platform,)).as_text()


@pytest.mark.parametrize("shape_name", ["decode-4k", "decode-16k-b8"])
@pytest.mark.parametrize(
  "blocks",
  [
    kernels.PagedBlocks(2, 1, num_stages=6, num_warps=8),
    kernels.PagedBlocks(8, 3, num_stages=3, num_warps=4),
  ],
  ids=str,
)
def test_paged_triton_tuner_configs_lower_at_production_shape(shape_name, blocks):
  """Tuner candidates beyond the defaults (32- and 128-token tiles, 2-6 pipeline stages, 8 warps,
  split-K) lower to one Triton kernel, with the blocks' num_stages / num_warps in its compiler params:
  a config the tuner would time but CUDA lowering rejects, or params silently dropped, fail here."""
  text = _lower_paged(shape_name, "pallas", blocks)
  assert text.count(backend.LOWERED_KERNEL_MARKERS["gpu"]) == 1
  assert f"num_stages = {blocks.num_stages} : i32, num_warps = {blocks.num_warps} : i32" in text


@pytest.mark.parametrize("shape_name", ["decode-4k", "decode-16k-b8"])
@pytest.mark.parametrize("ring", [(4, 2, 3), (4, 5, 4), (8, 1, 2), (4, 16, 1)], ids=str)
def test_paged_mosaic_gpu_tuner_configs_lower_at_production_shape(shape_name, ring):
  """The Mosaic GPU ring at other depths (1-4 stages), 128-token tiles and split counts whose page ids
  stage as one or several rows (decode-4k, 1 split: 256 ids as 2 rows of 128): TMA gathers, the
  stale-V zeroing in the WGMMA layout and the live-rows write-back lower for sm_90."""
  from kernels.paged_attention.mosaic_gpu_blocks import MosaicPagedBlocks

  text = _lower_paged(shape_name, "mosaic_gpu", MosaicPagedBlocks(*ring))
  assert text.count(backend.MOSAIC_GPU_MARKER) == 1
  assert backend.LOWERED_KERNEL_MARKERS["gpu"] not in text


@pytest.mark.parametrize("shape_name", ["qwen2.5-3b-8k", "qwen2.5-3b-16k"])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_fused_linear_mosaic_gpu_lowers_at_production_shape(shape_name, grad):
  """The Mosaic GPU fused LM-head kernels lower for sm_90 at N = 8192 / 16384, H = 2048, V = 151936
  (wgmma from swizzled TMA tiles, WGMMA-layout row reductions, dynamic chunk offsets proven
  multiples of block_v). The loss alone runs the statistics kernel; differentiated, the dlogits
  kernel too: one instance inside the loop over full vocabulary chunks, one for the tail chunk."""
  text = lower_fused_linear("gpu", LINEAR_LOSS_SHAPES[shape_name], "mosaic_gpu", grad=grad)
  assert text.count(backend.MOSAIC_GPU_MARKER) == (3 if grad else 1)
  # impl="pallas" on GPU is the same Mosaic GPU kernels for bf16 (no Triton variant of the fused
  # loss), and the chunked path (its Triton softmax kernels) for f32, which wgmma cannot meet
  if not grad:
    shape = LINEAR_LOSS_SHAPES[shape_name]
    pallas = lower_fused_linear("gpu", shape, "pallas", grad=False)
    assert pallas.count(backend.MOSAIC_GPU_MARKER) == 1
    f32 = lower_fused_linear(
      "gpu", dataclasses.replace(shape, dtype="float32"), "pallas", grad=False
    )
    assert backend.MOSAIC_GPU_MARKER not in f32
    assert f32.count(backend.LOWERED_KERNEL_MARKERS["gpu"]) == 1


@pytest.mark.parametrize("shape_name", ["qwen2.5-3b-8k", "qwen2.5-3b-16k"])
def test_fused_linear_mosaic_gpu_stored_columns_lower_at_production_shape(shape_name):
  """The tuner's stored-columns candidate (the statistics kernel also TMA-stores exp(z - m) and the
  row max of its first tiles under a dynamic ``pl.when``; the rest of the vocabulary in dlogits
  chunks from a non-zero start) lowers for sm_90 at N = 8192 / 16384, H = 2048, V = 151936, with
  loss_scale on the path as the loop passes it: statistics + dlogits (loop) + dlogits (tail)."""
  from kernels.fused_linear import mosaic_gpu_blocks as mg

  shape = LINEAR_LOSS_SHAPES[shape_name]
  cands = [b for b in mg.candidate_blocks(shape, "gpu") if b.stored_cols]
  assert cands, "no stored-columns candidate within the temp target"
  text = lower_fused_linear("gpu", shape, "mosaic_gpu", grad=True, blocks=cands[0], loss_scale=0.25)
  assert text.count(backend.MOSAIC_GPU_MARKER) == 3


def test_fused_linear_mosaic_gpu_spec_options_lower_at_production_shape():
  """Sequence-level options: statistics pass, [B, T] objective in XLA, then the gradient pass."""
  shape = LINEAR_LOSS_SHAPES["qwen2.5-3b-8k"]
  text = lower_fused_linear("gpu", shape, "mosaic_gpu", grad=True, **SPEC_OPTIONS)
  assert text.count(backend.MOSAIC_GPU_MARKER) == 3


@pytest.mark.parametrize(
  "tree,rule",
  [
    ("qwen2.5-0.5b", "adamw"),
    ("qwen2.5-1.5b", "adamw"),
    pytest.param("qwen2.5-1.5b", "lion", marks=pytest.mark.slow),  # ~20 s; AdamW covers the path
  ],
)
def test_optimizer_step_lowers_as_one_launch_at_production_trees(tree, rule):
  """The bench's 0.5B / 1.5B f32 trees (290 / 338 leaves), the donated in-place step: ONE Triton
  launch for the whole tree (a per-leaf or per-dtype fallback would count hundreds), every param and
  state leaf aliased into it (a dropped alias is an XLA copy: 2 extra words per element)."""
  from bench.shapes import decoder_param_shapes

  shapes = decoder_param_shapes(tree)
  specs = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  make = kernels.optim.fused_adamw_step if rule == "adamw" else kernels.optim.fused_lion_step
  tx, step = make(1e-3, impl="pallas")
  target = backend.make_target("gpu", interpret=False)
  with backend.use_target("gpu", interpret=False):
    state = jax.eval_shape(tx.init, specs)
    text = (
      jax.jit(step, donate_argnums=(0, 2))
      .trace(specs, specs, state)
      .lower(lowering_platforms=(target.lowering_platform,))
      .as_text()
    )
  assert text.count(backend.LOWERED_KERNEL_MARKERS["gpu"]) == 1
  n_slots = 2 if rule == "adamw" else 1
  assert text.count("stablehlo.output_operand_alias<") == len(shapes) * (1 + n_slots)


@pytest.mark.parametrize("shape_name", PRODUCTION_LOSS_SHAPES)
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_mosaic_gpu_cluster_loss_lowers_at_production_shape(shape_name, grad):
  """The cluster-split kernels (ClusterLossBlocks: 8-CTA clusters) lower for sm_90: the bulk copies
  of each CTA's 1/8 row slice, the strided register layouts of the in-shared-memory sweeps, the
  cluster barriers and the DSMEM read of the peers' partials (plgpu.cluster_ref), which the
  interpreter cannot run. One kernel: the statistics forward, or the training kernel."""
  from kernels.grpo_loss import mosaic_gpu_blocks

  shape = LOSS_SHAPES[shape_name]
  blocks = mosaic_gpu_blocks.default_cluster_blocks(jnp.dtype(shape.dtype), shape.vocab)
  assert blocks.cluster == 8
  text = lower_loss("gpu", shape, grad=grad, impl="mosaic_gpu", blocks=blocks)
  assert text.count(backend.MOSAIC_GPU_MARKER) == 1
  assert backend.LOWERED_KERNEL_MARKERS["gpu"] not in text
