"""`python -m rl.train --config X --check` (and rl.agent): is config X valid for its platform? Nothing runs.

The platform is the config's (configs/gpu-*.yaml: gpu, tpu-*: tpu, cpu-*: cpu; `--platform` names
another; any other file name: this host's). In order, each a ConfigError naming the key:
  1. the loss implementation exists there (rl.config.platform.LOSS_IMPLS; already checked at load);
  2. the mesh: the batch splits over its fixed axes, tp divides the heads and the vocabulary;
  3. rl.train: the dataset's longest prompt leaves room under rollout.max_seq_len;
  4. a memory estimate per device (weights, gradients, optimizer state, reference weights, the KV
     pool, unfused logits), against the device's memory where the table knows it (a lower bound:
     activations are left out, so a config over it surely does not fit);
  5. a TPU config naming its slice (mesh.topology, or --topology) with libtpu installed: the run's
     sharded programs compiled for the slice's abstract devices (rl.aot.slice_check: per-device memory
     against the generation's HBM, "fits" or "does not fit by N GiB", Mosaic calls, compile seconds,
     the decode step's bytes); else AOT lowering, from this host, for the platform
     (kernels.backend.use_target; for GPU the abstract H100), of the train step and of the rollout's
     decode chunk at the config's shapes, with the abstract (eval_shape) model: no weights are
     allocated, nothing is compiled for the host (a TPU config says how to get libtpu).
`check` returns the figures; the command prints them and exits 0, or 2 with the one error.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from kernels import tpu_targets
from kernels.backend import Platform, make_target, use_target
from rl.aot import programs, slice_check
from rl.aot.programs import abstract_cache, decode_chunk_program, train_step_program
from rl.config import GRPOConfig
from rl.config import platform as platforms
from rl.configlib import ConfigError
from rl.data.prompts import TEMPLATES
from rl.model import abstract_model, preset
from rl.optimizer import make_optimizer
from rl.run import setup

GIB = 2**30
# Memory of one device of each platform the estimate is checked against: the H100 80GB the GPU
# configs were written for. TPU: unchecked (the generation, and so the memory, varies).
DEVICE_MEMORY_GIB: dict[str, float] = {"gpu": 80.0}


def check(
  cfg: GRPOConfig,
  platform: Platform,
  entry: str = "rl.train",
  lower: bool = True,
  layers: int | None = None,
  out: dict | None = None,
  decode_bytes: bool = True,
) -> dict:
  """Every check of the module docstring for `cfg` on `platform`; the figures as a dict (`out`,
  filled as they come, so a caller still has them when a check raises). `layers`: check a declared
  reduced-layer twin of the model (its figures are the twin's); `decode_bytes`: a slice check also
  accounts the decode step's bytes (two more compiles)."""
  out = {} if out is None else out
  out.update(platform=platform, entry=entry)
  tcfg = cfg.train
  out["loss_impl"] = platforms.loss_impl(platform, tcfg.fused_lm_head, tcfg.policy_loss_impl)
  sl = cfg.mesh.slice if platform == "tpu" else None
  devices = _check_mesh(cfg, None if sl is None else sl.devices)
  cfg = cfg.resolved(devices)
  out["devices"] = devices
  model_cfg = _model_config(cfg)
  if layers is not None:
    model_cfg = dataclasses.replace(model_cfg, num_layers=layers)
    out["layers_twin"] = layers
  _check_tp(cfg, model_cfg)
  if entry == "rl.train":
    out["prompt_width"] = _prompt_width(cfg)
  else:  # episodes: the widest prompt rl.agent.step.episode_widths can fix (see _lower_agent_update)
    out["prompt_width"] = setup.round_up(cfg.rollout.max_seq_len, setup.WIDTH_ALIGN)
  _check_memory_estimate(cfg, model_cfg, platform, out)
  if not lower:
    return out
  if sl is not None and tpu_targets.libtpu_available():
    out["slice"] = report = {}  # filled as the programs compile: the caller keeps it on an error
    slice_check.check_slice(
      cfg, model_cfg, out["prompt_width"], out["loss_impl"], sl.name, report, decode_bytes, entry
    )
    if not report["fits"]:
      raise ConfigError(slice_check.summary(report).splitlines()[-1].strip())
    return out
  if sl is not None:  # no deviceless TPU compiler here: lower only, as before
    out["note"] = NO_LIBTPU
  out["lowered_s"] = lower_steps(
    cfg, model_cfg, platform, out["prompt_width"], out["loss_impl"], entry
  )
  return out


NO_LIBTPU = (
  "libtpu is not installed, so the programs were lowered (not compiled) and the memory is an "
  f'estimate; to compile for the slice: pip install "jax[tpu]=={jax.__version__}" (or nox -s '
  "tpu_compile)"
)


def _check_memory_estimate(cfg: GRPOConfig, model_cfg, platform: Platform, out: dict) -> None:
  memory = memory_estimate(cfg, model_cfg, out["prompt_width"])
  out["memory_gib"] = {k: round(v / GIB, 2) for k, v in memory.items()}
  limit = DEVICE_MEMORY_GIB.get(platform)
  if limit is not None and memory["total"] > limit * GIB:
    parts = ", ".join(f"{k} {v:.1f}" for k, v in out["memory_gib"].items() if k != "total")
    raise ConfigError(
      f"the estimate of one {platform} device's memory, {memory['total'] / GIB:.1f} GiB ({parts}; "
      f"activations not counted), exceeds its {limit:.0f} GiB: lower train.micro_batch_size, "
      "rollout.max_slots or rollout.max_seq_len, or shard over more devices (mesh.fsdp)"
    )


def _check_mesh(cfg: GRPOConfig, slice_devices: int | None = None) -> int:
  """The devices the check assumes: the slice's (mesh.topology), else the product of the fixed mesh
  axes (a -1 axis: one device, the smallest such mesh). The batch must split over them (the
  derived sizes raise ValueError)."""
  mesh = cfg.mesh
  devices = slice_devices or abs(mesh.dp * mesh.fsdp * mesh.tp)
  try:
    resolved = cfg.resolved(devices)
    resolved.grad_accum_steps  # noqa: B018 (validates)
    resolved.sft_accum_steps  # noqa: B018
  except ValueError as e:
    raise ConfigError(f"mesh on {devices} device(s): {e}") from e
  return devices


def _model_config(cfg: GRPOConfig):
  if cfg.model.checkpoint:  # a local HF directory's config.json (rl.model.checkpoint reads it)
    from rl.model.checkpoint import _model_config as read_config

    try:
      return read_config(cfg.model.checkpoint, **cfg.model.overrides)
    except (OSError, ValueError) as e:
      raise ConfigError(f"model.checkpoint={cfg.model.checkpoint}: {e}") from e
  try:
    return preset(cfg.model.preset, **cfg.model.overrides)
  except (KeyError, ValueError) as e:
    raise ConfigError(f"model.preset={cfg.model.preset}: {e}") from e


def _check_tp(cfg: GRPOConfig, model_cfg) -> None:
  tp = cfg.mesh.tp
  for name in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):
    size = getattr(model_cfg, name)
    if size % tp:
      raise ConfigError(
        f"mesh.tp={tp} does not divide the model's {name}={size} ({cfg.model.preset}): pick a "
        f"tp that divides it"
      )


def _prompt_width(cfg: GRPOConfig) -> int:
  """The update's prompt width, by the loop's own loaders and rule: the check and the run agree."""
  tokenizer = setup.tokenizer_of(cfg)
  template = TEMPLATES[cfg.data.template]
  train_data, test_data = setup.load_data(cfg)
  encode = lambda q: template.encode(q, tokenizer)
  return setup.check_prompt_room(cfg, encode, train_data, test_data)


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def memory_estimate(cfg: GRPOConfig, model_cfg, prompt_width: int) -> dict[str, int]:
  """Bytes per device of what a step surely holds: the weights, f32 gradient accumulators, the
  optimizer state and the reference weights (train.beta > 0), sharded over fsdp x tp; the rollout's
  KV pool and (unfused LM head) one micro-batch's f32 logits with their gradient."""
  params = nnx.state(abstract_model(model_cfg), nnx.Param)
  shards = cfg.mesh.fsdp * cfg.mesh.tp
  tcfg = cfg.train
  optimizer = make_optimizer(tcfg.optimizer, tcfg.learning_rate, 0.0, 1.0, fused=False)
  weights = _bytes(params)
  grads = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(params))
  out = {
    "weights": weights // shards,
    "gradients": grads // shards,
    "optimizer": _bytes(jax.eval_shape(optimizer.init, params)) // shards,
    "reference": (weights if tcfg.beta > 0 else 0) // shards,
    "kv_pool": _bytes(abstract_cache(cfg, model_cfg)),
    "logits": 0
    if tcfg.fused_lm_head
    else 2 * 4 * tcfg.micro_batch_size * cfg.sampling.max_new_tokens * model_cfg.vocab_size,
  }
  out["total"] = sum(out.values())
  return out


def lower_steps(
  cfg: GRPOConfig,
  model_cfg,
  platform: Platform,
  prompt_width: int,
  impl: str,
  entry: str = "rl.train",
):
  """Lowers (traces and converts to the platform's MLIR; no XLA compile) the update at one device's
  [K, M, P + C] batch (rl.train: the GRPO train step; rl.agent: its policy + critic update at
  P + C = rollout.max_seq_len) and the paged decode chunk at [max_slots] slots; seconds of each."""
  target = make_target(platform, interpret=platform == "cpu")
  seconds = {}
  platforms_arg = (target.lowering_platform,)
  with use_target(platform, target.interpret):
    t = time.perf_counter()
    if entry == "rl.agent":
      step, args = programs.agent_update_program(cfg, model_cfg, impl)
    else:
      step, args = train_step_program(
        cfg, model_cfg, prompt_width, impl, cfg.train.micro_batch_size
      )
    step.trace(*args).lower(lowering_platforms=platforms_arg)
    seconds["train_step"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    chunk, args = decode_chunk_program(cfg, model_cfg)
    chunk.trace(*args).lower(lowering_platforms=platforms_arg)
    seconds["decode_chunk"] = round(time.perf_counter() - t, 2)
  return seconds
