"""`--check` on a TPU slice: the run's real sharded programs compiled for the slice's abstract devices.

`check_slice` builds, with the shardings the run uses (rl.aot.programs), the train step (the config's
loss impl, remat and optimizer), the reference / old log-prob pass when the config uses one (for
rl.agent: its update with the critic, and its pre-update log-prob / value pass), the rollout's
prefill and its decode chunk, and compiles each with libtpu's compiler for the slice's
generation (`kernels.backend.tpu_devices`, `use_target("tpu", interpret=False, generation=...)`). A
multi-host slice (v4-16: 2 hosts) is one program over all its chips for the update; the rollout runs
on each host's own chips (rl.run.setup.rollout_replica), so its programs compile over host 0's.

Memory, per device, from the compiler (`memory_analysis()`): each program's arguments, temporaries
and peak, plus what the run keeps beside it — the trainer state (weights + optimizer state, + the
reference when beta > 0), the rollout weights (the compute-dtype copy the engine reads) and the KV pool
— against the generation's HBM (`Slice.generation.hbm_bytes`, the compiler's own figure): "fits" or
"does not fit by N GiB" with the largest values of the worst program. The decode step's bytes come
from XLA's cost analysis on one chip: the decode chunk with a single (unrolled) layer, plus L - 1
trips of the layer scan's body compiled alone (one layer's step on its own weights: the cost model
bills a loop body once, and charges a static slice of stacked weights as the whole stack, so neither
the scanned chunk nor an unrolled multi-layer twin counts the layers right); the paged kernel's own
reads are not in XLA's count (a custom call), so the live KV it reads is added (modelled), next to
the ideal: weights once in the compute dtype + the live KV once + the logits.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp

from kernels import backend, tpu_targets
from rl.aot import programs
from rl.aot.decode_bytes import ITEM_BYTES, MOSAIC, PREFETCH, decode_account
from rl.config import GRPOConfig
from rl.configlib import ConfigError
from rl.rollout.engine import bucket
from rl.run.setup import rollout_mesh
from rl.sharding import make_mesh

GIB = 2**30


@dataclasses.dataclass
class Compiled:
  """One program's figures per device (bytes; compiled)."""

  name: str
  compile_s: float
  argument: int
  output: int
  alias: int
  temp: int
  peak: int  # the program's own peak (arguments + temporaries + outputs not aliased)
  beside: int = 0  # what the run keeps resident beside the program's arguments
  mosaic_calls: int = 0  # tpu_custom_call instructions (Pallas kernels)
  prefetches: int = 0  # cross-program prefetches: parameters copied into VMEM before it starts
  largest: tuple = ()  # (bytes, shape, op) of the largest values: where a program's memory goes

  @property
  def total(self) -> int:
    return self.peak + self.beside

  def row(self) -> dict:
    g = lambda b: round(b / GIB, 3)
    return {
      "compile_s": round(self.compile_s, 1),
      "arguments_gib": g(self.argument),
      "temporaries_gib": g(self.temp),
      "peak_gib": g(self.peak),
      "resident_beside_gib": g(self.beside),
      "total_gib": g(self.total),
      "mosaic_calls": self.mosaic_calls,
    }


def slice_meshes(cfg: GRPOConfig, sl: tpu_targets.Slice):
  """(the config resolved for the slice, the update's mesh over every chip, the rollout's mesh: the
  same on one host, host 0's chips on several)."""
  devices = backend.tpu_devices(sl.name)
  try:
    cfg = cfg.resolved(len(devices))
    m = cfg.mesh
    mesh = make_mesh(m.dp, m.fsdp, m.tp, devices=devices[: m.dp * m.fsdp * m.tp])
    cfg.grad_accum_steps  # noqa: B018 (validates the batch over the resolved mesh)
  except ValueError as e:
    raise ConfigError(f"mesh on the {sl.name} slice ({len(devices)} devices): {e}") from e
  if sl.hosts == 1:
    return cfg, mesh, mesh
  local = [d for d in devices if d.process_index == devices[0].process_index]
  return cfg, mesh, rollout_mesh(local, m.tp)


def per_device(tree) -> int:
  """Bytes one device holds of `tree` (ShapeDtypeStructs placed on a mesh, or unplaced: whole)."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def compile_program(name: str, fn, args) -> Compiled:
  """Trace, lower and compile `fn` at `args` for the current target; its per-device figures."""
  t = time.perf_counter()
  compiled = fn.trace(*args).lower().compile()
  seconds = time.perf_counter() - t
  m = compiled.memory_analysis()
  peak = int(getattr(m, "peak_memory_in_bytes", 0)) or (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )
  hlo = compiled.as_text()
  return Compiled(
    name,
    seconds,
    int(m.argument_size_in_bytes),
    int(m.output_size_in_bytes),
    int(m.alias_size_in_bytes),
    int(m.temp_size_in_bytes),
    peak,
    mosaic_calls=hlo.count(MOSAIC),
    prefetches=hlo.count(PREFETCH),
    largest=tuple(largest_values(hlo)),
  )


_VALUE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ((?:\w+)\[[0-9,]*\])\S* (\w[\w\-]*)\(")


def largest_values(hlo: str, top: int = 6) -> list[tuple[int, str, str]]:
  """The largest array values of the compiled program's top-level computations (bytes, shape, op):
  the candidates for its biggest temporaries (fusion internals are not buffers, so skipped)."""
  called = set(re.findall(r"calls=%([\w.\-]+)", hlo))
  found, skip = {}, False
  for line in hlo.splitlines():
    if line and not line.startswith(" "):
      name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      skip = name in called and not line.startswith("ENTRY")
    m = None if skip else _VALUE.match(line)
    if m is None or m.group(3) in ("parameter", "get-tuple-element", "bitcast", "tuple"):
      continue
    dtype, dims = m.group(2).split("[")
    if dtype in ITEM_BYTES:
      size = ITEM_BYTES[dtype] * math.prod(int(d) for d in dims[:-1].split(",") if d)
      found[(m.group(2), m.group(3))] = max(size, found.get((m.group(2), m.group(3)), 0))
  return sorted(((b, s, op) for (s, op), b in found.items()), reverse=True)[:top]


def compile_error(name: str, cfg: GRPOConfig, error: Exception) -> ConfigError:
  """A compile failure as a ConfigError naming the config key behind it."""
  text = str(error)
  if "cannot be automatically partitioned" in text:
    key = "rollout.attn_impl" if name in ("decode_chunk", "prefill") else "train.policy_loss_impl"
    return ConfigError(
      f"{name}: a Pallas kernel sits in a program over {cfg.mesh.dp * cfg.mesh.fsdp * cfg.mesh.tp} "
      f"devices and the kernels here are not shard-local yet (kernels.sharding, rl.kernel_sharding):"
      f" set {key}=xla (or rollout.backend=dense) until they are; the compiler: {text[:300]}"
    )
  return ConfigError(f"{name} does not compile for the slice: {text[:1200]}")


@dataclasses.dataclass(frozen=True)
class Resident:
  """What the run holds on device 0 (the worst: it also rolls out on a multi-host slice) between its
  programs, per device, in bytes (from the shardings the run uses)."""

  params: int  # the policy's weights (param dtype)
  opt_state: int
  reference: int  # the frozen reference (train.beta > 0), else 0
  rollout_weights: int  # the compute-dtype weights the engine reads
  kv_pool: int

  @property
  def trainer(self) -> int:
    return self.params + self.opt_state + self.reference

  @property
  def total(self) -> int:
    return self.trainer + self.rollout_weights + self.kv_pool

  def row(self) -> dict:
    fields = {k: round(v / GIB, 3) for k, v in dataclasses.asdict(self).items()}
    return {
      **fields,
      "trainer_state": round(self.trainer / GIB, 3),
      "total": round(self.total / GIB, 3),
    }


def resident(cfg: GRPOConfig, model_cfg, rollout_mesh, params, opt_state) -> Resident:
  """`opt_state`: every optimizer state the trainer keeps (rl.agent: the critic's weights too)."""
  _, weights = programs.rollout_state(model_cfg, rollout_mesh)
  cache = programs.abstract_cache(cfg, model_cfg, rollout_mesh)
  return Resident(
    per_device(params),
    per_device(opt_state),
    per_device(params) if cfg.train.beta > 0 else 0,
    per_device(weights),
    per_device((cache.k, cache.v)),
  )


def build_programs(
  cfg: GRPOConfig, model_cfg, prompt_width: int, impl: str, mesh, rollout_mesh, entry: str
):
  """{name: (jitted, abstract args)} of every program the run compiles, in the run's layouts; the
  update's program first."""
  micro = cfg.global_micro_batch
  if entry == "rl.agent":
    out = {
      "update": programs.agent_update_program(cfg, model_cfg, impl, mesh),
      "old_logps_values": programs.agent_values_program(cfg, model_cfg, mesh),
    }
  else:
    out = {
      "train_step": programs.train_step_program(cfg, model_cfg, prompt_width, impl, micro, mesh)
    }
    if cfg.train.beta > 0 or cfg.train.ppo_epochs > 1:
      out["logps"] = programs.logps_program(cfg, model_cfg, prompt_width, micro, mesh)
  ecfg = cfg.rollout
  rows = bucket(max(ecfg.max_slots // cfg.sampling.group_size, 1), minimum=1)  # one row a group
  width = min(bucket(prompt_width), ecfg.pages_per_seq * ecfg.page_size)
  out["prefill"] = programs.prefill_program(cfg, model_cfg, rows, width, rollout_mesh)
  out["decode_chunk"] = programs.decode_chunk_program(cfg, model_cfg, rollout_mesh)
  return out


def _trainer_state(name: str, args) -> tuple:
  """(params, every optimizer state + the critic) of the update program `name`'s arguments."""
  if name == "update":  # rl.agent: ((params, critic, opt_state, critic's opt_state), batch)
    params, head, opt_state, head_opt = args[0]
    return params, (head, opt_state, head_opt)
  params, opt_state, _ = args
  return params, opt_state


def beside(name: str, res: Resident, multi_host: bool) -> int:
  """What the run holds beside program `name`'s own arguments while it runs."""
  if name in ("train_step", "update"):  # params + optimizer state are its arguments
    return res.kv_pool + res.reference + (res.rollout_weights if multi_host else 0)
  if name in ("logps", "old_logps_values"):  # one set of weights is an argument, the rest resident
    return res.opt_state + res.kv_pool + res.reference + (res.rollout_weights if multi_host else 0)
  return res.trainer  # prefill / decode: the rollout weights and the pool are arguments


def check_slice(
  cfg: GRPOConfig,
  model_cfg,
  prompt_width: int,
  impl: str,
  slice_name: str,
  report: dict | None = None,
  decode_bytes: bool = True,
  entry: str = "rl.train",
) -> dict:
  """Compiles the run's programs (`entry`'s: rl.train or rl.agent) for `slice_name`; the figures
  (see the module docstring), filled into `report` as they come. Raises ConfigError when a program
  does not compile."""
  sl = tpu_targets.Slice.parse(slice_name)
  gen = sl.generation
  cfg, mesh, rollout_mesh = slice_meshes(cfg, sl)
  report = {} if report is None else report
  report.update(slice=sl.name, hosts=sl.hosts, devices=sl.devices, entry=entry)
  report["libtpu"] = tpu_targets.libtpu_version()
  report["mesh"] = dict(mesh.shape)
  report["rollout_mesh"] = dict(rollout_mesh.shape)
  report["layers"] = model_cfg.num_layers
  compiled: dict[str, Compiled] = {}
  with backend.use_target("tpu", interpret=False, generation=gen.name):
    built = build_programs(cfg, model_cfg, prompt_width, impl, mesh, rollout_mesh, entry)
    update = next(iter(built))
    res = resident(cfg, model_cfg, rollout_mesh, *_trainer_state(update, built[update][1]))
    for name, (fn, args) in built.items():
      try:
        compiled[name] = compile_program(name, fn, args)
      except Exception as e:  # the compiler's own error (Mosaic partitioning, HBM) names the cause
        report["error"] = f"{name}: {str(e)[:2000]}"
        raise compile_error(name, cfg, e) from e
      compiled[name].beside = beside(name, res, sl.hosts > 1)
    if decode_bytes:
      report.update(decode_account(cfg.rollout, model_cfg, backend.tpu_devices(sl.name)[0]))
  worst = max(compiled.values(), key=lambda c: c.total)
  report["programs"] = {k: c.row() for k, c in compiled.items()}
  report["compile_s"] = {k: round(c.compile_s, 1) for k, c in compiled.items()}
  report["mosaic_calls"] = {k: c.mosaic_calls for k, c in compiled.items()}
  report["cross_program_prefetches"] = {k: c.prefetches for k, c in compiled.items()}
  report["resident_gib"] = res.row()
  report["hbm_per_device_gib"] = round(worst.total / GIB, 3)
  report["hbm_capacity_gib"] = round(gen.hbm_bytes / GIB, 3)
  report["worst_program"] = worst.name
  report["fits"] = worst.total <= gen.hbm_bytes
  report["headroom"] = round(1 - worst.total / gen.hbm_bytes, 3)
  if not report["fits"]:
    report["largest"] = [f"{b / GIB:.2f} GiB {s} {op}" for b, s, op in worst.largest]
  return report


def summary(report: dict) -> str:
  """The human-readable lines of a slice check."""
  g = lambda k: report.get(k, "?")
  lines = [
    f"{g('slice')} ({g('hosts')} host(s), {g('devices')} devices, mesh {g('mesh')}, rollout mesh "
    f"{g('rollout_mesh')}, {g('layers')} layers, libtpu {g('libtpu')}): per device, compiled"
  ]
  if "error" in report:
    lines.append(f"  error: {report['error'][:600]}")
  for name, row in report.get("programs", {}).items():
    lines.append(
      f"  {name:13s} compile {row['compile_s']:7.1f} s  arguments {row['arguments_gib']:7.2f}  "
      f"temporaries {row['temporaries_gib']:7.2f}  peak {row['peak_gib']:7.2f}  + resident "
      f"{row['resident_beside_gib']:6.2f} = {row['total_gib']:7.2f} GiB  Mosaic calls "
      f"{row['mosaic_calls']}"
    )
  if "resident_gib" in report:
    r = report["resident_gib"]
    lines.append(
      f"  resident: trainer state {r['trainer_state']:.2f} (weights {r['params']:.2f}, optimizer "
      f"{r['opt_state']:.2f}, reference {r['reference']:.2f}) + rollout weights "
      f"{r['rollout_weights']:.2f} + KV pool {r['kv_pool']:.2f} = {r['total']:.2f} GiB"
    )
  if "decode_bytes_per_step" in report:
    lines.append(
      f"  decode step: {report['decode_bytes_per_step'] / 1e9:.2f} GB accessed (XLA "
      f"{report['decode_xla_bytes_per_step'] / 1e9:.2f} + kernel KV reads "
      f"{report['decode_kernel_kv_bytes_per_step'] / 1e9:.2f}, modelled) vs ideal "
      f"{report['decode_ideal_bytes_per_step'] / 1e9:.2f} GB: {report['decode_ratio']:.2f}x "
      f"({report['decode_slots']} slots on one chip)"
    )
  if "fits" in report:
    cap, peak = report["hbm_capacity_gib"], report["hbm_per_device_gib"]
    verdict = (
      f"fits: {peak:.2f} of {cap:.2f} GiB ({100 * report['headroom']:.0f} % headroom)"
      if report["fits"]
      else f"does not fit by {peak - cap:.2f} GiB ({report['worst_program']}: {peak:.2f} of "
      f"{cap:.2f} GiB); largest values: {'; '.join(report['largest'])}"
    )
    lines.append(f"  {verdict}")
  return "\n".join(lines)
