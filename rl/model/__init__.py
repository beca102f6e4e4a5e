"""The Qwen-family decoder: config, presets, Flax NNX model, KV-cache interface, checkpoints, sharding."""

from rl.model.cache import DenseKVCache, KVCache
from rl.model.checkpoint import load_checkpoint, save_checkpoint
from rl.model.config import ModelConfig
from rl.model.partition import param_shardings, shard_model
from rl.model.presets import PRESETS, preset
from rl.model.qwen import Qwen, abstract_model, init_model, scale_weights

__all__ = [
  "PRESETS",
  "DenseKVCache",
  "KVCache",
  "ModelConfig",
  "Qwen",
  "abstract_model",
  "init_model",
  "load_checkpoint",
  "param_shardings",
  "preset",
  "save_checkpoint",
  "scale_weights",
  "shard_model",
]
