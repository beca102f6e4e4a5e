"""What a run sets up once, before its first step: the data, the tokenizer, the model, the mesh and the
optimizers, with the up-front checks that stop a bad config before anything compiles (prompt room,
process counts) and the packed widths fixed from the data. `rl.train.Trainer`, `rl.agent` and
`rl.check` (--check) build from these functions, so a check and a run agree.
"""

from __future__ import annotations

import contextlib

import jax

from kernels.optim import partition_specs_of
from rl import sharding
from rl.config import GRPOConfig, TrainSection
from rl.configlib import ConfigError
from rl.data import Example, generate_synthetic, load_gsm8k
from rl.data.gsm8k import default_dir as gsm8k_default_dir
from rl.model import init_model, load_checkpoint, preset, shard_model
from rl.tokenizer import load_tokenizer
from rl.update import make_optimizer, warmup_schedule

# Packed widths are multiples of this. They are fixed before step 1 from the data (the train split's
# longest prompt, and its longest worked solution for the SFT warm-up), so the update, the reference /
# old log-prob passes and the SFT step each compile once per run (issue 31: a width rounded per step
# recompiled the 0.5B update every few steps on GSM8K, ~50 s each on an H100).
WIDTH_ALIGN = 32


def load_data(cfg: GRPOConfig) -> tuple[list[Example], list[Example]]:
  data_cfg = cfg.data
  if data_cfg.dataset == "gsm8k":
    with reading("data.path", data_cfg.path):
      path = data_cfg.path or gsm8k_default_dir()
      train = load_gsm8k(path, "train", data_cfg.train_limit)
      test = load_gsm8k(path, "test", data_cfg.eval_limit)
  else:
    levels = data_cfg.synthetic_levels
    train = generate_synthetic(data_cfg.train_limit or data_cfg.synthetic_train, 1, levels)
    test = generate_synthetic(data_cfg.eval_limit or data_cfg.synthetic_test, 2, levels)
  if not train or not test:
    raise ConfigError(
      f"data.dataset={data_cfg.dataset} has {len(train)} train and {len(test)} test examples"
    )
  return train, test


def build_model(cfg: GRPOConfig, mesh):
  model_cfg = cfg.model
  dtypes = dict(dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype)
  if model_cfg.checkpoint:
    with reading("model.checkpoint", model_cfg.checkpoint):
      return load_checkpoint(model_cfg.checkpoint, mesh=mesh, **dtypes)
  with reading("model.preset", model_cfg.preset):
    architecture = preset(model_cfg.preset, **dtypes)
  return shard_model(init_model(architecture, seed=cfg.train.seed), mesh)


def tokenizer_of(cfg: GRPOConfig):
  """model.tokenizer's, else model.checkpoint's, else the embedded byte-level tokenizer."""
  key = "model.tokenizer" if cfg.model.tokenizer else "model.checkpoint"
  path = cfg.model.tokenizer or cfg.model.checkpoint
  with reading(key, path):
    return load_tokenizer(path)


@contextlib.contextmanager
def reading(key: str, value):
  """A missing, truncated or unusable file named by config key `key` is a ConfigError naming the key
  (the loaders' messages name the file)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, OSError) as e:
    raise ConfigError(f"{key}={value}: {e}") from e


def learning_rate_schedule(train_cfg: TrainSection, learning_rate: float, steps: int):
  """train.lr_warmup_steps and train.lr_schedule applied to one phase of `steps` updates (the SFT
  warm-up, or the RL phase): a float or an optax schedule."""
  decay = steps if train_cfg.lr_schedule == "cosine" else 0
  return warmup_schedule(learning_rate, train_cfg.lr_warmup_steps, decay)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def check_prompt_room(cfg: GRPOConfig, encode, train_data, test_data) -> int:
  """A ConfigError if the longest prompt of either split leaves no room under rollout.max_seq_len
  (GSM8K's byte-level prompts reach 1134 tokens: the embedded default's 256 fits only the synthetic
  task); the message asks for room for max_new_tokens too. Returns the update's prompt width: the
  train split's longest prompt (every GRPO step draws from it), rounded up to WIDTH_ALIGN."""
  longest = max(len(encode(e.question)) for e in (*train_data, *test_data))
  need = longest + cfg.sampling.max_new_tokens
  # the engine's own rule: a prompt must leave room for one new token (a completion that reaches
  # max_seq_len early finishes as "length", as one that reaches max_new_tokens does)
  if longest + 1 > cfg.rollout.max_seq_len:
    raise ConfigError(
      f"rollout.max_seq_len={cfg.rollout.max_seq_len} is too short for "
      f"data.dataset={cfg.data.dataset}: its longest prompt is {longest} tokens; with "
      f"sampling.max_new_tokens={cfg.sampling.max_new_tokens}, set rollout.max_seq_len >= "
      f"{round_up(need, cfg.rollout.page_size)}"
    )
  return round_up(max(len(encode(e.question)) for e in train_data), WIDTH_ALIGN)


def resolve_mesh(cfg: GRPOConfig):
  """(the config with a concrete mesh for this process's devices, the mesh); ConfigErrors for axes
  the devices do not fill and batches that do not divide over the processes."""
  try:
    cfg = cfg.resolved(jax.device_count())
    mesh = sharding.mesh_for(cfg.mesh.dp, cfg.mesh.fsdp, cfg.mesh.tp)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  procs = jax.process_count()
  if cfg.train.prompts_per_step % procs or cfg.global_micro_batch % procs:
    raise ConfigError(
      f"train.prompts_per_step={cfg.train.prompts_per_step} and the global micro-batch "
      f"{cfg.global_micro_batch} must divide over the {procs} processes"
    )
  return cfg, mesh


def optimizer_for(cfg: GRPOConfig, mesh, params, learning_rate: float, steps: int):
  """train.optimizer at `learning_rate` with the config's schedule over `steps` updates; fused, each
  device updating its own shard when the mesh has several devices."""
  train_cfg = cfg.train
  specs = partition_specs_of(params) if mesh.size > 1 else None
  return make_optimizer(
    train_cfg.optimizer,
    learning_rate_schedule(train_cfg, learning_rate, steps),
    train_cfg.weight_decay,
    train_cfg.max_grad_norm,
    train_cfg.fused_optimizer,
    mesh if specs is not None else None,
    specs,
  )
