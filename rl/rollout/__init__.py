"""Rollout: sample GRPO groups from the live policy. `make_engine(model, config)` picks the backend.

Backends share one interface (`generate(prompts, params) -> RolloutResult`) and the same device steps:
  * ``paged``: continuous batching on the paged KV cache, decode attention in `kernels.paged_attention`
    (attn_impl "pallas" / "mosaic_gpu"; "auto" on TPU / GPU) or the model's own attention over the
    gathered pages (attn_impl "xla"; "auto" on CPU).
  * ``dense``: a static batch on a dense cache, the reference sampler.
  * ``sglang_jax``: sglang-jax's Engine in this process, weights synced in memory before each generate
    (optional: the `sglang` extra, Python >= 3.12).
"""

from __future__ import annotations

from rl.rollout.config import BACKENDS, EngineConfig
from rl.rollout.dense import DenseEngine
from rl.rollout.engine import RolloutEngine
from rl.rollout.paged import PagedEngine
from rl.rollout.types import Completion, RolloutResult, RolloutStats, SamplingParams

__all__ = [
  "BACKENDS",
  "Completion",
  "DenseEngine",
  "EngineConfig",
  "PagedEngine",
  "RolloutEngine",
  "RolloutResult",
  "RolloutStats",
  "SamplingParams",
  "make_engine",
]


def make_engine(model, config: EngineConfig, tokenizer=None, eos_ids=None) -> RolloutEngine:
  """The backend `config.backend` names, holding a reference to `model` (its live parameters)."""
  if config.backend == "paged":
    return PagedEngine(model, config, tokenizer, eos_ids)
  if config.backend == "dense":
    return DenseEngine(model, config, tokenizer, eos_ids)
  if config.backend == "sglang_jax":
    from rl.rollout.sglang_jax import SglangJaxEngine  # imports sglang-jax only when asked for

    return SglangJaxEngine(model, config, tokenizer, eos_ids)
  raise ValueError(f"unknown rollout backend {config.backend!r}")
