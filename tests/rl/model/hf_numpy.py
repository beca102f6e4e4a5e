"""An independent float64 NumPy forward of HF's Qwen2/Qwen3 decoder, written from the HF state dict.

It reads tensors by their HF names (torch [out, in] layout) and follows transformers' modeling_qwen2 /
modeling_qwen3 step by step, so it shares no code with `rl.model`: a wrong name mapping, transpose, RoPE
layout or norm placement in the Flax model shows up as a mismatch.
"""

import numpy as np


def _rms(x, w, eps):
  return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, theta):  # x: [T, heads, D]
  t, _, d = x.shape
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
  ang = np.arange(t)[:, None] * inv  # [T, D/2]
  emb = np.concatenate([ang, ang], -1)[:, None, :]
  rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
  return x * np.cos(emb) + rot * np.sin(emb)


def forward(sd: dict, hf: dict, tokens) -> np.ndarray:  # tokens [T] -> logits [T, V]
  sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
  eps, theta = hf["rms_norm_eps"], hf["rope_theta"]
  nh, nkv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
  qwen3 = hf["model_type"] == "qwen3"
  x = sd["model.embed_tokens.weight"][np.asarray(tokens)]
  t = x.shape[0]
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rms(x, sd[p + "input_layernorm.weight"], eps)

    def proj(name, h=h, p=p):
      y = h @ sd[p + f"self_attn.{name}.weight"].T
      return y + sd[p + f"self_attn.{name}.bias"] if p + f"self_attn.{name}.bias" in sd else y

    q, k, v = (
      proj("q_proj").reshape(t, nh, d),
      proj("k_proj").reshape(t, nkv, d),
      proj("v_proj").reshape(t, nkv, d),
    )
    if qwen3:
      q, k = (
        _rms(q, sd[p + "self_attn.q_norm.weight"], eps),
        _rms(k, sd[p + "self_attn.k_norm.weight"], eps),
      )
    q, k = _rope(q, theta), _rope(k, theta)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    a = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(t, nh * d)
    x = x + a @ sd[p + "self_attn.o_proj.weight"].T
    h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
    g, u = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
    x = x + (g / (1 + np.exp(-g)) * u) @ sd[p + "mlp.down_proj.weight"].T
  x = _rms(x, sd["model.norm.weight"], eps)
  head = sd["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else sd["lm_head.weight"]
  return x @ head.T
