"""What a run sets up once, before its first step: the data, the tokenizer, the model, the mesh, the
rollout engine, the optimizers, the metric sinks and the checkpointer, with the up-front checks that
stop a bad config before anything compiles (prompt room, process counts) and the packed widths fixed
from the data. `build` gathers them into one frozen `Setup`; `Policy` holds what moves (the weights,
their optimizer state, the frozen reference). `rl.train`, `rl.agent` and `rl.aot.check` (--check) build
from these functions, so a check and a run agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kernels.backend import host_platform
from kernels.optim import partition_specs_of
from rl import configlib, sharding
from rl.config import GRPOConfig, TrainSection, platform
from rl.configlib import ConfigError
from rl.data import Example, generate_synthetic, load_gsm8k
from rl.data.gsm8k import default_dir as gsm8k_default_dir
from rl.data.prompts import TEMPLATES
from rl.data.tokenizer import load_tokenizer
from rl.logging.metrics import CompileWatch, MetricsWriter, StepAverage, StepTimer
from rl.logging.wandb_sink import open_sink
from rl.model import init_model, load_checkpoint, partition, preset, shard_model
from rl.optimizer import (
  Optimizer,
  init_optimizer_state,
  make_optimizer,
  shardings_of,
  warmup_schedule,
)
from rl.rollout import make_engine
from rl.run.checkpointing import Checkpointer
from rl.update import Batch

# Packed widths are multiples of this. They are fixed before step 1 from the data (the train split's
# longest prompt, and its longest worked solution for the SFT warm-up), so the update, the reference /
# old log-prob passes and the SFT step each compile once per run (issue 31: a width rounded per step
# recompiled the 0.5B update every few steps on GSM8K, ~50 s each on an H100).
WIDTH_ALIGN = 32


def load_data(cfg: GRPOConfig) -> tuple[list[Example], list[Example]]:
  """The run's (train, test) examples: `data.dataset`'s files or the synthetic problems, limited by
  `data.train_limit` / `data.eval_limit`; a missing or unreadable file is a ConfigError naming
  `data.path`."""
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
  if model_cfg.checkpoint:
    with reading("model.checkpoint", model_cfg.checkpoint):
      return load_checkpoint(model_cfg.checkpoint, mesh=mesh, **model_cfg.overrides)
  with reading("model.preset", model_cfg.preset):
    architecture = preset(model_cfg.preset, **model_cfg.overrides)
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
  """`n` rounded up to a multiple of `m`."""
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


@dataclasses.dataclass(frozen=True)
class Clock:
  """A run's step clock: phase timers, the steady step average and the compile counter."""

  timer: StepTimer = dataclasses.field(default_factory=StepTimer)
  step_avg: StepAverage = dataclasses.field(default_factory=lambda: StepAverage(10))
  compiles: CompileWatch = dataclasses.field(default_factory=CompileWatch)


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything a run builds once (`build`), read by its step, its evals and its run loop."""

  cfg: GRPOConfig  # with a concrete mesh
  mesh: Any  # jax.sharding.Mesh
  tokenizer: Any
  template: Any  # rl.data.prompts' template of data.template
  train_data: list[Example]
  test_data: list[Example]
  model: nnx.Module  # the live policy (its weights follow Policy.params)
  graphdef: Any  # the policy's nnx graph
  rollout_model: nnx.Module  # the model the engine reads: the policy, or a local replica
  engine: Any  # rl.rollout's engine
  loss_impl: str  # the loss impl this host's platform has (rl.config.platform.loss_impl)
  optimizer: Optimizer  # the RL phase's
  sft_optimizer: Optimizer  # the SFT warm-up's
  prompt_width: int | None  # the single-turn update's prompt width (None: rl.agent's episodes)
  writer: MetricsWriter
  checkpointer: Checkpointer
  clock: Clock
  encoded: dict[str, list[int]] = dataclasses.field(default_factory=dict)

  @property
  def is_main(self) -> bool:
    return jax.process_index() == 0

  def encode(self, question: str) -> list[int]:
    """The question's prompt tokens under data.template (cached: the prompt-room check encodes
    every question once)."""
    if question not in self.encoded:
      self.encoded[question] = self.template.encode(question, self.tokenizer)
    return self.encoded[question]

  def to_batch(
    self,
    tokens: np.ndarray,  # [N_local, T]
    mask: np.ndarray,  # [N_local, T]
    advantages: np.ndarray,  # [N_local]
    sampler_logps: np.ndarray | None = None,  # [N_local, C] the engine's, 0 on padding
    accum_steps: int | None = None,  # K; None: the GRPO step's grad_accum_steps
    support_gaps: np.ndarray | None = None,  # [N_local, C] the engine's support gaps, or None
  ) -> Batch:
    """This process's rows -> the global [K, M, ...] batch."""
    k = accum_steps or self.cfg.grad_accum_steps
    put = lambda x: global_rows(self.mesh, k, x)
    f32 = lambda x: None if x is None else put(x.astype(np.float32))
    return Batch(
      put(tokens),
      put(mask),
      f32(advantages),
      sampler_logps=f32(sampler_logps),
      support_gaps=f32(support_gaps),
    )

  def close(self) -> None:
    self.clock.compiles.close()
    self.writer.close()
    self.checkpointer.close()
    self.engine.close()


def global_rows(mesh, k: int, x: np.ndarray) -> jax.Array:  # x: [N_local, ...] -> [K, M, ...]
  """This process's rows [N_local, ...] -> the global [K, M, ...] array on the mesh."""
  return sharding.global_batch(mesh, x.reshape(k, x.shape[0] // k, *x.shape[1:]))


def build(cfg: GRPOConfig, prompt_room: bool = True) -> Setup:
  """The run's set-up, every config error first (before anything compiles). `prompt_room`: check
  the dataset's prompts against rollout.max_seq_len and fix the update's prompt width (rl.train;
  rl.agent's prompts are environment observations, its widths are its own)."""
  cfg, mesh = resolve_mesh(cfg)
  tcfg = cfg.train
  # the loss impl this host's platform has: a ConfigError now, not a minute into compiling
  impl = platform.loss_impl(host_platform(), tcfg.fused_lm_head, tcfg.policy_loss_impl)
  tokenizer = tokenizer_of(cfg)
  template = TEMPLATES[cfg.data.template]  # the config checked the name
  train_data, test_data = load_data(cfg)
  encoded: dict[str, list[int]] = {}  # Setup.encode's cache, filled by the prompt-room check

  def encode(question: str) -> list[int]:
    if question not in encoded:
      encoded[question] = template.encode(question, tokenizer)
    return encoded[question]

  width = check_prompt_room(cfg, encode, train_data, test_data) if prompt_room else None
  model = build_model(cfg, mesh)
  if tokenizer.vocab_size > model.cfg.vocab_size:
    key = "model.tokenizer" if cfg.model.tokenizer else "model.checkpoint"
    raise ConfigError(
      f"{key}: the tokenizer has {tokenizer.vocab_size} tokens, the model only "
      f"{model.cfg.vocab_size}"
    )
  graphdef, params = nnx.split(model, nnx.Param)
  # Several processes: each rolls out its own prompts on a local replica of the weights.
  replica = lambda: rollout_replica(params, model.cfg.compute_dtype, cfg.mesh.tp)
  rollout_model = model if jax.process_count() == 1 else nnx.merge(graphdef, replica())
  engine = make_engine(rollout_model, cfg.rollout, tokenizer)
  optimizer_with = functools.partial(optimizer_for, cfg, mesh, params)
  sft_rate = tcfg.sft_learning_rate or tcfg.learning_rate
  is_main = jax.process_index() == 0
  wandb = open_sink(cfg.run.wandb, cfg.run.out_dir, configlib.to_dict(cfg)) if is_main else None
  writer = MetricsWriter(cfg.run.out_dir, is_main, cfg.run.tensorboard, wandb)
  checkpointer = Checkpointer(
    os.path.join(cfg.run.out_dir, "checkpoints"), cfg.run.checkpoint_every
  )
  if is_main:
    configlib.dump(cfg, os.path.join(cfg.run.out_dir, "config.yaml"))
  return Setup(
    cfg, mesh, tokenizer, template, train_data, test_data, model, graphdef, rollout_model, engine,
    impl, optimizer_with(tcfg.learning_rate, tcfg.steps),
    optimizer_with(sft_rate, tcfg.warmup_sft_steps), width, writer, checkpointer, Clock(), encoded,
  )  # fmt: skip


def rollout_replica(params, compute_dtype, tp: int = 1):
  """The multi-process rollout's replica of the weights: gathered on this host, cast to the compute
  dtype the engine reads anyway (rl.rollout.steps.rollout_weights), and laid out by the partition
  rules over this process's own devices (`rollout_mesh`), so a host's chips share its rollout (the
  7B's f32 weights on one v4 chip were 30 GB of its 30.75 GiB)."""
  mesh = rollout_mesh(jax.local_devices(), tp)

  def place(path, x):
    x = np.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(compute_dtype)
    spec = partition.spec_for(partition.path_name(path), x.shape, mesh)
    return jax.device_put(x, NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(place, sharding.allgather(params))


def rollout_mesh(devices, tp: int = 1):
  """The mesh a process rolls out on when several share a run: its own `devices`, fsdp over them
  (and tp, as the run's, where it divides them). rl.aot.slice_check lays host 0's out the same way."""
  return sharding.make_mesh(1, -1, tp if len(devices) % tp == 0 else 1, devices=devices)


class Policy:
  """What moves during a run: the policy's weights (the model and the rollout's replica follow
  them), their optimizer state and the frozen reference of the KL term (train.beta > 0)."""

  def __init__(self, setup: Setup):
    self.setup = setup
    self.params = nnx.split(setup.model, nnx.Param)[1]
    self.opt_state = init_optimizer_state(setup.optimizer, self.params, setup.mesh)
    self.shardings = (shardings_of(self.params), shardings_of(self.opt_state))
    # The reference policy: a frozen copy of the weights GRPO starts from (taken again after the SFT
    # warm-up, checkpointed with the run), kept only when the KL term is on.
    self.ref_params = self.frozen_copy() if setup.cfg.train.beta > 0 else None

  def frozen_copy(self):
    return jax.tree.map(jnp.copy, self.params)

  def set_params(self, params) -> None:
    self.params = params
    nnx.update(self.setup.model, params)
    if self.setup.rollout_model is not self.setup.model:
      replica = rollout_replica(params, self.setup.model.cfg.compute_dtype, self.setup.cfg.mesh.tp)
      nnx.update(self.setup.rollout_model, replica)

  def state(self) -> dict:
    """What a checkpoint holds of the policy."""
    state = {"params": self.params, "opt_state": self.opt_state}
    if self.ref_params is not None:
      state["ref_params"] = self.ref_params
    return state

  def restore(self, state: dict) -> None:
    """Takes back what `state()` saved."""
    self.opt_state = state["opt_state"]
    self.set_params(state["params"])
    self.ref_params = state.get("ref_params", self.ref_params)


# ---------------------------------------------------------------------------------------- data order
def example_at(cfg: GRPOConfig, data: list[Example], pos: int, stream: int) -> Example:
  """The example at position `pos` of the infinite sequence of seeded permutations of `data`
  (stream 0: the GRPO steps' prompts, 1: the SFT warm-up's solutions)."""
  return data[permuted_index(cfg, len(data), pos, stream)]


def permuted_index(cfg: GRPOConfig, n: int, pos: int, stream: int) -> int:
  epoch, i = divmod(pos, n)
  return int(np.random.default_rng([cfg.train.seed, stream, epoch]).permutation(n)[i])


def prompt_seed(cfg: GRPOConfig, step: int, index: int) -> int:
  """The sampling seed of global prompt `index` of step `step`."""
  return (cfg.train.seed * 1_000_003 + step * 65_537 + index) % (2**31)
