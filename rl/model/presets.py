"""Named decoder shapes, so benchmarks run at real sizes with random weights and nothing downloaded.

The real-size presets copy the published `config.json` of each checkpoint (architecture fields only).
`tiny` and `cpu-small` size the embedded default: vocabulary = the embedded byte tokenizer's, padded to
a multiple of 128 so the LM head tiles cleanly on TPU.
"""

from __future__ import annotations

from rl.model.config import ModelConfig

EMBEDDED_VOCAB = 384  # >= rl.data.tokenizer.ByteTokenizer().vocab_size, a multiple of 128.

_QWEN25 = dict(
  vocab_size=151936,
  rope_theta=1_000_000.0,
  rms_norm_eps=1e-6,
  max_position_embeddings=32768,
  qkv_bias=True,
  qk_norm=False,
  model_type="qwen2",
  bos_token_id=151643,
  eos_token_id=151645,
)
_QWEN3 = dict(
  vocab_size=151936,
  head_dim=128,
  rope_theta=1_000_000.0,
  rms_norm_eps=1e-6,
  max_position_embeddings=40960,
  qkv_bias=False,
  qk_norm=True,
  model_type="qwen3",
  bos_token_id=151643,
  eos_token_id=151645,
)

PRESETS: dict[str, ModelConfig] = {
  # CPU tests: small enough that a forward + backward compiles and runs in about a second.
  "tiny": ModelConfig(
    vocab_size=EMBEDDED_VOCAB,
    hidden_size=64,
    intermediate_size=176,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
  ),
  "tiny-qwen3": ModelConfig(
    vocab_size=EMBEDDED_VOCAB,
    hidden_size=64,
    intermediate_size=176,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    qkv_bias=False,
    qk_norm=True,
    model_type="qwen3",
    tie_word_embeddings=False,
  ),
  # The smallest shape sglang-jax 0.1.0rc0's attention runs (head_dim 128, >= 2 KV heads): its tests.
  "tiny-h128": ModelConfig(
    vocab_size=EMBEDDED_VOCAB,
    hidden_size=256,
    intermediate_size=176,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
  ),
  # The embedded default of the training loop: learns the synthetic task on CPU in minutes.
  "cpu-small": ModelConfig(
    vocab_size=EMBEDDED_VOCAB,
    hidden_size=128,
    intermediate_size=352,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
  ),
  "qwen2.5-0.5b": ModelConfig(
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    tie_word_embeddings=True,
    **_QWEN25,
  ),
  "qwen2.5-1.5b": ModelConfig(
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    tie_word_embeddings=True,
    **_QWEN25,
  ),
  "qwen2.5-3b": ModelConfig(
    hidden_size=2048,
    intermediate_size=11008,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    tie_word_embeddings=True,
    **_QWEN25,
  ),
  "qwen2.5-7b": ModelConfig(
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    tie_word_embeddings=False,
    **{**_QWEN25, "vocab_size": 152064},
  ),
  "qwen3-0.6b": ModelConfig(
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    tie_word_embeddings=True,
    **_QWEN3,
  ),
  "qwen3-1.7b": ModelConfig(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    tie_word_embeddings=True,
    **_QWEN3,
  ),
  # Qwen3-4B (config.json of Qwen/Qwen3-4B) and its 2507 instruct release (Qwen/Qwen3-4B-Instruct-2507:
  # the same architecture with rope_theta 5e6 and a 262144-token context): the seed's v4-8 run.
  "qwen3-4b": ModelConfig(
    hidden_size=2560,
    intermediate_size=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    tie_word_embeddings=True,
    **_QWEN3,
  ),
  "qwen3-4b-instruct-2507": ModelConfig(
    hidden_size=2560,
    intermediate_size=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    tie_word_embeddings=True,
    **{**_QWEN3, "rope_theta": 5_000_000.0, "max_position_embeddings": 262144},
  ),
}


def preset(name: str, **overrides) -> ModelConfig:
  """The named preset, with optional field overrides (e.g. `dtype="float32"`)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides)
