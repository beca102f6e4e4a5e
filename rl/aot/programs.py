"""The run's compiled programs at the config's shapes, from abstract inputs, laid out as the run lays
them out: what `--check` lowers or compiles and `bench.loop.compile_time` times. Nothing is allocated.

Each `*_program` returns (the jitted function, its abstract arguments). With a `mesh` the arguments are
`jax.ShapeDtypeStruct`s placed as the run places the real arrays — parameters by the partition rules
(rl.model.partition), the optimizer state like the parameters it tracks (rl.optimizer), a batch's
rows over the batch axes (dp, fsdp), the KV cache as the engine creates it and the decode rows as the
engine puts them (rl.rollout.engine) — so a compile for a slice's abstract devices is the program
the run will execute there. Without one they are unplaced (lowering for a platform from this host).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rl import kernel_sharding
from rl.config import GRPOConfig
from rl.model import abstract_model
from rl.model.partition import param_shardings
from rl.optimizer import make_optimizer, opt_state_shardings
from rl.rollout import steps
from rl.rollout.config import EngineConfig
from rl.rollout.engine import decode_kernel_sharding, kv_sharding, row_sharding
from rl.rollout.paged_cache import PagedKVCache
from rl.rollout.sampling import sample_base_keys
from rl.run import setup
from rl.sharding import data_axes
from rl.update import Batch, LossSettings, batch_token_logps, compile_train_step


def placed(tree, shardings=None):
  """`tree`'s leaves as ShapeDtypeStructs on `shardings` (a matching tree, one sharding for every
  leaf, or None: unplaced)."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


def abstract_params(model_cfg, mesh=None):
  """(graphdef, the Param state as ShapeDtypeStructs placed by the partition rules on `mesh`)."""
  model = abstract_model(model_cfg)
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, placed(params, None if mesh is None else param_shardings(model, mesh))


def run_optimizer(cfg: GRPOConfig, params, mesh=None):
  """The RL phase's optimizer as rl.run.setup.optimizer_for builds it (fused kernels per shard when the
  mesh has several devices)."""
  tcfg = cfg.train
  sharded = mesh is not None and mesh.size > 1
  specs = jax.tree.map(lambda x: x.sharding.spec, params) if sharded else None
  return make_optimizer(
    tcfg.optimizer,
    setup.learning_rate_schedule(tcfg, tcfg.learning_rate, tcfg.steps),
    tcfg.weight_decay,
    tcfg.max_grad_norm,
    tcfg.fused_optimizer,
    mesh if sharded else None,
    specs,
  )


def loss_settings(cfg: GRPOConfig, impl: str, mesh=None) -> LossSettings:
  """The GRPO loss settings as rl.step.GRPOStep builds them for a run on `mesh`."""
  return LossSettings(
    completion_len=cfg.sampling.max_new_tokens,
    spec=cfg.loss_spec,
    impl=impl,
    fused_lm_head=cfg.train.fused_lm_head,
    remat=cfg.train.remat,
    kernel_sharding=kernel_sharding.batch_sharding(mesh),
  )


def abstract_batch(cfg: GRPOConfig, prompt_width: int, micro_batch: int, mesh=None) -> Batch:
  """[K, micro_batch, P + C] tokens and mask, [K, M] advantages, [K, M, C] log-probs (old / ref only
  where the config uses them), rows over the batch axes on `mesh`."""
  k, c, tcfg = cfg.grad_accum_steps, cfg.sampling.max_new_tokens, cfg.train
  rows = None if mesh is None else NamedSharding(mesh, P(None, data_axes()))
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
  f32 = lambda *shape: sds(shape, jnp.float32)
  return Batch(
    sds((k, micro_batch, prompt_width + c), jnp.int32),
    sds((k, micro_batch, prompt_width + c), jnp.bool_),
    f32(k, micro_batch),
    old_logps=f32(k, micro_batch, c) if tcfg.ppo_epochs > 1 else None,
    ref_logps=f32(k, micro_batch, c) if tcfg.beta > 0 else None,
    sampler_logps=f32(k, micro_batch, c),
  )


def train_step_program(
  cfg: GRPOConfig, model_cfg, prompt_width: int, impl: str, micro_batch: int, mesh=None
):
  """The loop's GRPO train step (jitted, the config's loss, remat, optimizer and schedule; params and
  optimizer state donated and pinned to their layout) and its abstract (params, opt_state, batch) at
  [K, micro_batch, P + C]; `micro_batch` is the global micro-batch on a mesh."""
  graphdef, params = abstract_params(model_cfg, mesh)
  optimizer = run_optimizer(cfg, params, mesh)
  opt_state = jax.eval_shape(optimizer.init, params)
  state_shardings = None
  if mesh is not None:
    opt_state = placed(opt_state, opt_state_shardings(opt_state, params, mesh))
    state_shardings = (
      jax.tree.map(lambda x: x.sharding, params),
      jax.tree.map(lambda x: x.sharding, opt_state),
    )
  settings = loss_settings(cfg, impl, mesh)
  step = compile_train_step(graphdef, optimizer, settings, "grpo", state_shardings)
  return step, (params, opt_state, abstract_batch(cfg, prompt_width, micro_batch, mesh))


def _agent_parts(cfg: GRPOConfig, model_cfg, mesh=None):
  """rl.agent's abstract update inputs as rl.agent.step.AgentStep lays them out: (graphdef, params,
  the critic's graphdef, its params, its optax optimizer, the [K, M] batch). The critic (a value head,
  or a separate model) and its optimizer state are replicated; the batch is [K, M] packed episodes
  over the batch axes at the widest (P, C) rl.agent.step.episode_widths can fix: P <= round_up(longest
  prompt, 32) and C = round_up(max_seq_len - shortest, 32), each at most max_seq_len rounded up (no
  environment to reset here, so the widest update the run can compile)."""
  from rl.agent.critic import CriticModel, ValueHead
  from rl.agent.update import AgentBatch, head_optimizer
  from rl.model import Qwen
  from rl.model.presets import preset

  tcfg = cfg.train
  graphdef, params = abstract_params(model_cfg, mesh)
  if tcfg.critic == "head":
    critic = nnx.eval_shape(lambda: ValueHead(model_cfg.hidden_size, rngs=nnx.Rngs(0)))
  else:
    trunk = model_cfg if tcfg.critic_preset is None else preset(tcfg.critic_preset)
    critic = nnx.eval_shape(
      lambda: CriticModel(Qwen(trunk, rngs=nnx.Rngs(0)), trunk.hidden_size, rngs=nnx.Rngs(0))
    )
  head_graphdef, head_params = nnx.split(critic, nnx.Param)
  head_opt = head_optimizer(cfg)
  head_params = placed(head_params, None if mesh is None else NamedSharding(mesh, P()))
  p = c = setup.round_up(cfg.rollout.max_seq_len, setup.WIDTH_ALIGN)
  # one micro-batch of the whole mesh, or (unplaced: lowered for a platform) of one device
  k, m = cfg.grad_accum_steps, tcfg.micro_batch_size if mesh is None else cfg.global_micro_batch
  rows = None if mesh is None else NamedSharding(mesh, P(None, data_axes()))
  sds = lambda width, dtype: jax.ShapeDtypeStruct((k, m, width), dtype, sharding=rows)
  f32 = lambda: sds(c, jnp.float32)
  batch = AgentBatch(
    sds(p + c, jnp.int32), sds(p + c, jnp.bool_), sds(c, jnp.bool_), f32(), f32(), f32(), f32(),
    f32() if tcfg.beta > 0 else None,
  )  # fmt: skip
  return graphdef, params, head_graphdef, head_params, head_opt, batch


def agent_update_program(cfg: GRPOConfig, model_cfg, impl: str, mesh=None):
  """rl.agent's update (rl.agent.update.update_step: the policy term + the value loss over the
  critic) as AgentStep compiles it, the policy's optimizer the run's, and its abstract (state =
  (params, critic params, their optimizer states), batch); see `_agent_parts`."""
  from rl.agent.update import compile_update, update_settings

  graphdef, params, head_graphdef, head_params, head_opt, batch = _agent_parts(cfg, model_cfg, mesh)
  policy_opt = run_optimizer(cfg, params, mesh)
  opt_state = jax.eval_shape(policy_opt.init, params)
  head_opt_state = jax.eval_shape(head_opt.init, head_params)
  if mesh is not None:
    opt_state = placed(opt_state, opt_state_shardings(opt_state, params, mesh))
    head_opt_state = placed(head_opt_state, NamedSharding(mesh, P()))
  state = (params, head_params, opt_state, head_opt_state)
  settings = update_settings(cfg, impl, batch.model_mask.shape[-1], mesh)
  update = compile_update(graphdef, head_graphdef, policy_opt, head_opt, settings, state)
  return update, (state, batch)


def agent_values_program(cfg: GRPOConfig, model_cfg, mesh=None):
  """rl.agent's pre-update pass (rl.agent.update.old_logps_and_values: the policy's log-probs and the
  critic's values, micro-batch by micro-batch) over the step's batch; see `_agent_parts`."""
  from rl.agent.update import old_logps_and_values

  graphdef, params, head_graphdef, head_params, _, batch = _agent_parts(cfg, model_cfg, mesh)
  c, temp = batch.model_mask.shape[-1], cfg.sampling.temperature
  return old_logps_and_values, (graphdef, head_graphdef, params, head_params, batch, c, temp)


def logps_program(cfg: GRPOConfig, model_cfg, prompt_width: int, micro_batch: int, mesh=None):
  """The reference / old log-prob pass (rl.update.batch_token_logps) over the step's batch."""
  graphdef, params = abstract_params(model_cfg, mesh)
  batch = abstract_batch(cfg, prompt_width, micro_batch, mesh)
  s = cfg.sampling
  return batch_token_logps, (graphdef, params, batch, s.max_new_tokens, s.temperature)


def rollout_state(model_cfg, mesh=None):
  """(graphdef, the weights as the engine's steps read them: cast once to the compute dtype, laid
  out as the rollout model's parameters)."""
  model = abstract_model(model_cfg)
  graph, state = nnx.split(model)
  state = jax.eval_shape(lambda s: steps.rollout_weights(s, model_cfg.compute_dtype), state)
  return graph, placed(state, None if mesh is None else param_shardings(model, mesh))


def abstract_cache(cfg: GRPOConfig, model_cfg, mesh=None) -> PagedKVCache:
  """The paged engine's KV pool at the config's shapes, laid out as the engine creates it on `mesh`."""
  return abstract_pool(cfg.rollout, model_cfg, mesh)


def abstract_pool(ecfg: EngineConfig, model_cfg, mesh=None) -> PagedKVCache:
  """`abstract_cache` of an engine's own settings."""
  dtype = jnp.dtype(ecfg.cache_dtype or model_cfg.dtype)
  kernel = decode_kernel_sharding(mesh, model_cfg.num_kv_heads, ecfg.max_slots)
  cache = jax.eval_shape(
    lambda: PagedKVCache.create(
      model_cfg.num_layers,
      ecfg.pool_pages,
      ecfg.page_size,
      model_cfg.num_kv_heads,
      model_cfg.dim_per_head,
      dtype,
      ecfg.attn_impl,
      kernel_sharding=kernel,
    )
  )
  kv = kv_sharding(mesh, model_cfg.num_kv_heads, 4, 0)
  if kv is None:
    return cache
  return dataclasses.replace(cache, k=placed(cache.k, kv), v=placed(cache.v, kv))


def _with_table(cache, rows: int, width: int, sharding=None):
  table = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=_rows_spec(sharding, 2))
  return cache.with_table(table)


def _rows_spec(rows, ndim: int):  # a [rows, ...] array's layout from the rows' sharding
  return None if rows is None else NamedSharding(rows.mesh, P(rows.spec[0], *[None] * (ndim - 1)))


def prefill_program(cfg: GRPOConfig, model_cfg, rows: int, width: int, mesh=None):
  """The paged engine's prefill of `rows` prompts bucketed to `width` tokens (inputs as the engine
  passes them: uncommitted, so replicated over the mesh; the cache in its layout)."""
  graph, state = rollout_state(model_cfg, mesh)
  cache = _with_table(abstract_cache(cfg, model_cfg, mesh), rows, cfg.rollout.pages_per_seq)
  rep = None if mesh is None else NamedSharding(mesh, P())
  sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
  return steps.prefill, (graph, state, cache, sds((rows, width)), sds((rows, width)), sds((rows,)))


def decode_chunk_program(cfg: GRPOConfig, model_cfg, mesh=None, slots: int | None = None):
  """The paged engine's decode chunk and its abstract arguments as the engine passes them: weights
  cast once to the compute dtype, the KV pool, [slots] rows (default max_slots) split over the batch
  axes where the engine splits them, the plain sampler (filtered=False: no row uses top-k / top-p,
  as the GRPO configs sample)."""
  return engine_decode_program(cfg.rollout, model_cfg, mesh, slots)


def engine_decode_program(ecfg: EngineConfig, model_cfg, mesh=None, slots: int | None = None):
  """`decode_chunk_program` of an engine's own settings (bench.rollout.throughput's engines)."""
  s = slots or ecfg.max_slots
  graph, state = rollout_state(model_cfg, mesh)
  rows = row_sharding(mesh, ecfg.max_slots)
  cache = _with_table(abstract_pool(ecfg, model_cfg, mesh), s, ecfg.pages_per_seq, rows)
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=_rows_spec(rows, len(shape))
  )
  i32, f32 = sds((s,), jnp.int32), sds((s,), jnp.float32)
  keys = jax.eval_shape(lambda: sample_base_keys(np.zeros(s, np.uint32), np.zeros(s, np.int32)))
  keys = placed(keys, _rows_spec(rows, 1)) if rows is not None else keys
  slot_args = (i32, i32, i32, i32, sds((s, 1), jnp.int32), keys, f32, i32, f32)
  return steps.decode_chunk, (graph, state, cache, ecfg.steps_per_sync, False, *slot_args)


def engine_layer_program(ecfg: EngineConfig, model_cfg, slots: int | None = None):
  """One decoder layer's decode step as the decode chunk's layer scan runs it (one trip of the
  scan body): [slots] new tokens through the layer's own weights (compute dtype, unstacked) and a
  one-layer paged pool, the pool donated (updated in place). What the decode step's bytes are
  counted per layer from (rl.aot.decode_bytes.decode_account)."""
  s = slots or ecfg.max_slots
  one = dataclasses.replace(model_cfg, num_layers=1)
  layers = abstract_model(one).layers
  graphdef, stacked = nnx.split(layers)
  dt = model_cfg.compute_dtype
  cast = lambda x: jnp.dtype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], cast(x)), stacked)
  cache = _with_table(abstract_pool(ecfg, one), s, ecfg.pages_per_seq)

  def step(params, h, positions, cache):  # h: [S, 1, H], positions: [S, 1]
    return nnx.merge(graphdef, params)(h, positions, None, jnp.int32(0), cache)

  h = jax.ShapeDtypeStruct((s, 1, model_cfg.hidden_size), dt)
  positions = jax.ShapeDtypeStruct((s, 1), jnp.int32)
  return jax.jit(step, donate_argnums=3), (params, h, positions, cache)
