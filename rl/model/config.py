"""The decoder's hyper-parameters, and their mapping to and from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

# `model_type` values of the HF configs this decoder reproduces exactly.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Qwen2 / Qwen2.5 / Qwen3 decoder.

  `qkv_bias` is Qwen2's q/k/v projection bias; `qk_norm` is Qwen3's per-head RMSNorm on q and k.
  `dtype` is the compute dtype and `param_dtype` the storage dtype of the weights (f32 master weights
  with bf16 compute is the usual training setting). `batch_invariant`: every reduction in a fixed
  order and every rounding explicit (rl.model.numerics), so a rollout engine's decode step and the
  trainer's forward give a token the same hidden state, bit for bit (bf16 compute on XLA:CPU,
  tested; in f32 nothing is rounded and the matmuls' orders still differ in the last bits).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None  # None: hidden_size // num_heads (Qwen2); Qwen3 sets it explicitly.
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = True
  qkv_bias: bool = True
  qk_norm: bool = False
  model_type: str = "qwen2"
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  bos_token_id: int | None = None
  eos_token_id: int | list[int] | None = None
  batch_invariant: bool = False

  def __post_init__(self):
    positive = (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "max_position_embeddings",
    )
    for name in positive:
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise ValueError(
        f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
        "set head_dim explicitly"
      )
    if self.dim_per_head % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.dim_per_head}")
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type={self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    for name in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError as e:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is not a dtype") from e

  @property
  def dim_per_head(self) -> int:
    # Derived on read rather than stored, so `replace(hidden_size=...)` never keeps a stale value.
    return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  # --- Hugging Face config.json -----------------------------------------------------------------------

  @classmethod
  def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Reads a Qwen2/Qwen2.5/Qwen3 `config.json` dict; raises for features this decoder does not have."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
      None,
      "default",
    ):
      raise ValueError(f"rope_scaling={rope_scaling} is not supported (only plain RoPE)")
    if hf.get("use_sliding_window"):
      raise ValueError("use_sliding_window=true is not supported (full attention only)")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    num_heads = hf["num_attention_heads"]
    qwen3 = model_type == "qwen3"
    head_dim = hf.get("head_dim")
    if head_dim is not None and hf["hidden_size"] == head_dim * num_heads:
      head_dim = (
        None  # canonical form: None when it is the derived value, so round trips compare equal
      )
    kwargs = dict(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads", num_heads),
      head_dim=head_dim,
      rope_theta=float(hf.get("rope_theta", 10000.0)),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_position_embeddings=hf.get("max_position_embeddings", 32768),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      # Qwen2's config has no flag: its q/k/v projections always carry a bias. Qwen3 says so explicitly.
      qkv_bias=bool(hf.get("attention_bias", not qwen3)),
      qk_norm=qwen3,
      model_type=model_type,
      bos_token_id=hf.get("bos_token_id"),
      eos_token_id=hf.get("eos_token_id"),
    )
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf(self) -> dict[str, Any]:
    """The `config.json` a Hugging Face Qwen2/Qwen3 model class reads back to the same architecture."""
    hf = {
      "architectures": ["Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen2ForCausalLM"],
      "model_type": self.model_type,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.dim_per_head,
      "hidden_act": "silu",
      "rope_theta": self.rope_theta,
      "rms_norm_eps": self.rms_norm_eps,
      "max_position_embeddings": self.max_position_embeddings,
      "tie_word_embeddings": self.tie_word_embeddings,
      "attention_bias": self.qkv_bias,
      "use_sliding_window": False,
      "rope_scaling": None,
      "torch_dtype": self.param_dtype,
      "bos_token_id": self.bos_token_id,
      "eos_token_id": self.eos_token_id,
    }
    if self.model_type == "qwen2" and not self.qkv_bias:
      raise ValueError(
        "HF Qwen2 always has q/k/v biases; a qwen2 config without them cannot be saved"
      )
    if self.model_type == "qwen3" and not self.qk_norm:
      raise ValueError("HF Qwen3 always has q/k norms; a qwen3 config without them cannot be saved")
    return hf

  @classmethod
  def from_pretrained(cls, directory: str | os.PathLike, **overrides: Any) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"no config.json in {directory}")
    with open(path) as f:
      return cls.from_hf(json.load(f), **overrides)
