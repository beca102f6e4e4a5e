"""A Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX, numerically the Hugging Face definition.

The decoder layers are stored stacked (every layer parameter has a leading [L] axis) and applied with
one `jax.lax.scan`, so a forward traces and compiles one layer body instead of L copies: the standard
remedy for compile time (MaxText, tunix). Parameter names follow HF's up to that axis:
`layers.self_attn.q_proj.kernel[i]` is `model.layers.i.self_attn.q_proj.weight` transposed
(`rl.model.checkpoint` maps checkpoints by name). Kernels are [in, out]; the LM head is exposed as an
[H, V] matrix so the fused LM-head loss can consume it without materialising logits.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from rl.model import numerics
from rl.model.cache import KVCache, attention
from rl.model.config import ModelConfig

Array = jax.Array

_init = nnx.initializers.normal(stddev=0.02)  # HF's initializer_range
# Rematerialisation of a decoder layer in the backward (train.remat): what each layer keeps from its
# forward for the backward, the rest recomputed there. "none": everything (no recompute); "layer":
# its matmul outputs against the weights (attention scores, softmax and elementwise work recomputed);
# "full": only its input (the whole layer recomputed: the least memory, one more forward).
REMAT = {
  "none": None,
  "layer": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "full": jax.checkpoint_policies.nothing_saveable,
}
_UNROLL_LAYERS = contextvars.ContextVar("unroll_layers", default=False)


@contextlib.contextmanager
def unrolled_layers():
  """Trace the L layers one by one inside the block (same math, each layer's weights a static slice of
  the stack). For accounting only: XLA's cost analysis charges a while loop's body once, so a scanned
  decoder would be billed one layer per step; `bench.rollout.byte_account` compiles under this to charge all L."""
  token = _UNROLL_LAYERS.set(True)
  try:
    yield
  finally:
    _UNROLL_LAYERS.reset(token)


class RMSNorm(nnx.Module):
  """HF's Qwen2RMSNorm: normalise in f32, cast back, then scale. `invariant`: the mean square by
  `numerics.pairwise_sum` and each rounding by `numerics.round_to` (ModelConfig.batch_invariant)."""

  def __init__(self, dim: int, eps: float, param_dtype, invariant: bool = False):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.invariant = invariant

  def __call__(self, x: Array) -> Array:  # [..., dim]
    x32 = x.astype(jnp.float32)
    if not self.invariant:
      normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
      return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)
    mean_square = numerics.pairwise_sum(x32 * x32)[..., None] / x.shape[-1]
    normed = numerics.round_to(x32 * jax.lax.rsqrt(mean_square + self.eps), x.dtype)
    scale = numerics.param(self.scale[...], x.dtype)
    return numerics.round_to(scale * normed.astype(jnp.float32), x.dtype)


def rope(
  x: Array,  # [B, T, heads, D]
  positions: Array,  # [B, T] int32
  theta: float,
  invariant: bool = False,  # round with numerics.round_to (ModelConfig.batch_invariant)
) -> Array:
  """Rotary embedding in HF's rotate-half layout (first half pairs with second half), computed in f32."""
  d = x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return numerics.round_to(out, x.dtype) if invariant else out.astype(x.dtype)


def _linear(cfg: ModelConfig, din: int, dout: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(
    din,
    dout,
    use_bias=bias,
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    kernel_init=_init,
    rngs=rngs,
  )


def project(cfg: ModelConfig, layer: nnx.Linear, x: Array) -> Array:  # [..., din] -> [..., dout]
  """`layer(x)`; under ModelConfig.batch_invariant with f32 accumulation, rounded once where the
  model says (numerics.linear), in the decode step and the teacher-forced forward alike."""
  if not cfg.batch_invariant:
    return layer(x)
  bias = None if layer.bias is None else layer.bias[...]
  return numerics.linear(x.astype(cfg.compute_dtype), layer.kernel[...], bias)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d = cfg.dim_per_head
    self.q_proj = _linear(cfg, cfg.hidden_size, cfg.num_heads * d, cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, cfg.hidden_size, cfg.num_kv_heads * d, cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, cfg.hidden_size, cfg.num_kv_heads * d, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, cfg.num_heads * d, cfg.hidden_size, False, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.weight_dtype, cfg.batch_invariant)
      self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.weight_dtype, cfg.batch_invariant)
    self.cfg = cfg

  def __call__(
    self,
    x: Array,  # [B, T, H]
    positions: Array,  # [B, T]
    visible: Array | None,  # [B, T, T] (no cache) or None (the cache decides)
    layer: Array,  # [] int32 (traced under the layer scan)
    cache: KVCache | None,
  ) -> tuple[Array, KVCache | None]:
    cfg = self.cfg
    b, t, _ = x.shape
    d = cfg.dim_per_head
    q = project(cfg, self.q_proj, x).reshape(b, t, cfg.num_heads, d)
    k = project(cfg, self.k_proj, x).reshape(b, t, cfg.num_kv_heads, d)
    v = project(cfg, self.v_proj, x).reshape(b, t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv = cfg.batch_invariant
    q, k = rope(q, positions, cfg.rope_theta, inv), rope(k, positions, cfg.rope_theta, inv)
    if cache is None:
      out = attention(q, k, v, visible, invariant=inv)
    else:
      # the keyword only when set: a cache written before it existed still serves the default
      out, cache = cache.attend(layer, q, k, v, positions, **({"invariant": True} if inv else {}))
    return project(cfg, self.o_proj, out.reshape(b, t, cfg.num_heads * d)), cache


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, False, rngs)
    self.up_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, False, rngs)
    self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, False, rngs)
    self.cfg = cfg

  def __call__(self, x: Array) -> Array:  # [..., H]
    cfg = self.cfg
    if not cfg.batch_invariant:
      return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
    gate = project(cfg, self.gate_proj, x).astype(jnp.float32)
    up = project(cfg, self.up_proj, x).astype(jnp.float32)
    return project(cfg, self.down_proj, numerics.round_to(jax.nn.silu(gate) * up, x.dtype))


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(
      cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype, cfg.batch_invariant
    )
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(
      cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype, cfg.batch_invariant
    )
    self.mlp = MLP(cfg, rngs)
    self.invariant = cfg.batch_invariant

  def __call__(self, x, positions, visible, layer, cache):
    attn, cache = self.self_attn(self.input_layernorm(x), positions, visible, layer, cache)
    add = numerics.add if self.invariant else jnp.add
    x = add(x, attn)
    return add(x, self.mlp(self.post_attention_layernorm(x))), cache


class Qwen(nnx.Module):
  """The decoder. `__call__` gives final-norm hidden states; `logits` / `lm_head_weight` the head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(
      cfg.vocab_size,
      cfg.hidden_size,
      dtype=cfg.compute_dtype,
      param_dtype=cfg.weight_dtype,
      embedding_init=_init,
      rngs=rngs,
    )
    self.layers = _stacked_layers(cfg, rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype, cfg.batch_invariant)
    if not cfg.tie_word_embeddings:
      self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

  def __call__(
    self,
    tokens: Array,  # [B, T] int32
    attention_mask: Array | None = None,  # [B, T] bool/int, 0 = padding (left or right)
    positions: Array | None = None,  # [B, T] int32; default: count of real tokens before
    remat: str = "none",  # REMAT: what each layer keeps for a backward through this forward
  ) -> Array:  # [B, T, H] final-norm hidden states
    """The training / scoring forward over whole sequences: causal attention that skips padding."""
    if remat not in REMAT:
      raise ValueError(f"remat must be one of {list(REMAT)}, got {remat!r}")
    if attention_mask is None:
      attention_mask = jnp.ones(tokens.shape, jnp.bool_)
    attention_mask = attention_mask.astype(jnp.bool_)
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0).astype(jnp.int32)
    if self.cfg.batch_invariant:  # each row's real tokens first, in order: a key's column is its
      # position, as in a cache, so the pairwise sums pair the same terms (padding: a zero tail)
      order = jnp.argsort(~attention_mask, axis=1, stable=True)  # [B, T]
      take = lambda a: jnp.take_along_axis(a, order, axis=1)
      tokens, attention_mask, positions = take(tokens), take(attention_mask), take(positions)
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    visible = causal[None] & attention_mask[:, None, :]
    x, _ = self._run_layers(self.embed_tokens(tokens), positions, visible, None, remat)
    if self.cfg.batch_invariant:  # back to the caller's columns
      x = jnp.take_along_axis(x, jnp.argsort(order, axis=1)[..., None], axis=1)
    return self.norm(x)

  def forward_with_cache(
    self,
    tokens: Array,  # [B, T] int32 new tokens (a prompt chunk, or one token)
    positions: Array,  # [B, T] int32 their absolute positions
    cache: KVCache,
  ) -> tuple[Array, KVCache]:  # ([B, T, H] hidden, updated cache)
    """Prefill (T > 1) or decode (T = 1) through a cache the caller owns."""
    x, cache = self._run_layers(self.embed_tokens(tokens), positions, None, cache)
    return self.norm(x), cache

  def _run_layers(
    self,
    x: Array,  # [B, T, H]
    positions: Array,  # [B, T] int32
    visible: Array | None,  # [B, T, T] or None (the cache decides)
    cache: KVCache | None,
    remat: str = "none",
  ) -> tuple[Array, KVCache | None]:
    """The L layers as one scan over their stacked parameters. The cache rides in the carry (its
    update of layer i is in place) and `cache.attend` gets the layer as a traced int32 scalar.
    `remat` (REMAT) checkpoints the layer body: the scan then keeps what the policy saves."""
    graphdef, stacked = nnx.split(self.layers)

    def body(carry, xs):
      h, c = carry
      params, i = xs
      return nnx.merge(graphdef, params)(h, positions, visible, i, c), None

    if REMAT[remat] is not None:  # prevent_cse=False: the scan already keeps the recompute apart
      body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)

    index = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
    if _UNROLL_LAYERS.get():  # accounting only (see unrolled_layers): static per-layer slices
      carry = (x, cache)
      for i in range(self.cfg.num_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], stacked)
        carry, _ = body(carry, (layer, jnp.int32(i)))
      return carry
    (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked, index))
    return x, cache

  def lm_head_weight(self) -> Array:  # [H, V] in the compute dtype
    if self.cfg.tie_word_embeddings:
      return self.embed_tokens.embedding[...].T.astype(self.cfg.compute_dtype)
    return self.lm_head.kernel[...].astype(self.cfg.compute_dtype)

  def logits(self, hidden: Array) -> Array:  # [..., H] -> [..., V] f32
    return jnp.dot(
      hidden.astype(self.cfg.compute_dtype),
      self.lm_head_weight(),
      preferred_element_type=jnp.float32,
    )

  def blocked_logits(
    self, hidden: Array, block: int
  ) -> Array:  # [..., H] -> [..., V / block, block]
    """`logits` with the vocabulary cut into blocks of `block` tokens (V a multiple of it), from
    the LM head itself: cutting [..., V] logits after the head makes XLA TPU relay them out in
    memory (rl.rollout.sampling.sample_blocked reduces over the blocks). Free for a tied head (its
    [V, H] table cut along V is the same memory); an untied [H, V] kernel is relaid out instead
    (rl.rollout.steps.next_tokens keeps those on [..., V] logits)."""
    v, h = self.cfg.vocab_size, self.cfg.hidden_size
    if v % block:
      raise ValueError(f"blocked_logits: block={block} must divide the vocabulary ({v} tokens)")
    x = hidden.astype(self.cfg.compute_dtype)
    if self.cfg.tie_word_embeddings:  # the [V, H] table, cut along V: no transposed copy
      table = self.embed_tokens.embedding[...].astype(self.cfg.compute_dtype)
      w = table.reshape(v // block, block, h)
      return jnp.einsum("...h,nkh->...nk", x, w, preferred_element_type=jnp.float32)
    w = self.lm_head.kernel[...].astype(self.cfg.compute_dtype).reshape(h, v // block, block)
    return jnp.einsum("...h,hnk->...nk", x, w, preferred_element_type=jnp.float32)


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
  """One `DecoderLayer` whose parameters carry a leading [L] axis. The layers are drawn one by one in
  order and then stacked, so a seed gives the same weights as a per-layer model would (seeded runs and
  recorded results stay reproducible); under `nnx.eval_shape` nothing is materialised."""
  layers = [DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)]
  graphdef = nnx.graphdef(layers[0])
  states = [nnx.state(layer) for layer in layers]
  return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def init_model(cfg: ModelConfig, seed: int = 0) -> Qwen:
  """A randomly initialised decoder (HF's N(0, 0.02) init; norms at 1)."""
  return Qwen(cfg, rngs=nnx.Rngs(seed))


def scale_weights(model: Qwen, factor: float) -> Qwen:
  """Multiply every non-norm parameter by `factor`, in place. HF's init makes a near-uniform random
  model; scaled (x10), its greedy outputs vary and its log-probs are peaked, so token-for-token and
  log-prob comparisons between engines have something to catch."""
  params = nnx.state(model, nnx.Param)
  nnx.update(
    model,
    jax.tree_util.tree_map_with_path(
      lambda p, x: x if "norm" in jax.tree_util.keystr(p) else x * factor, params
    ),
  )
  return model


def abstract_model(cfg: ModelConfig) -> Qwen:
  """The decoder with `jax.ShapeDtypeStruct` leaves: the skeleton a checkpoint is loaded into."""
  return nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))
