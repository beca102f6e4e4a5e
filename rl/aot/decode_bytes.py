"""The decode step's bytes on one TPU chip, by XLA's cost analysis of the compiled programs, next to
the ideal (weights once in the compute dtype + the live KV once + the logits): `--check`'s decode
figure (rl.aot.slice_check) and bench.rollout.throughput's floor check on a TPU. See `decode_account`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp

from rl.aot import programs
from rl.model import qwen
from rl.rollout.config import EngineConfig

MOSAIC = 'custom_call_target="tpu_custom_call"'  # a Pallas (Mosaic) kernel in compiled TPU HLO
PREFETCH = "cross_program_prefetch_index="  # a parameter copied into VMEM before the program starts
# libtpu's option: no parameter copied into VMEM ahead of the program (see decode_account)
NO_PREFETCH = {"xla_max_cross_program_prefetches": 0}
ITEM_BYTES = dict(
  pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8, u64=8
)


def decode_account(ecfg: EngineConfig, model_cfg, device) -> dict:
  """Bytes per decode step of the decode chunk on one chip (all max_slots rows at the compiled
  context) by XLA's cost analysis: the chunk with one (unrolled) layer, plus L - 1 trips of the
  layer scan's body (rl.aot.programs.engine_layer_program: one layer's step, its own weights); the
  paged kernel's KV reads (a custom call XLA does not charge) are added as the live KV read once
  (modelled). Next to the ideal (decode_ideal).

  Both parts are compiled without cross-program prefetch (NO_PREFETCH), as the real chunk runs.
  Compiled alone, the layer program's largest weight is an entry parameter, which XLA copies into
  VMEM before the program starts, and the cost analysis bills that weight about 5 times over. In
  the real decode chunk the layer's weights are slices of the stacked [L, ...] parameters inside
  the layer scan, which XLA does not prefetch: the compiled chunk holds no cross-program prefetch
  (rl.aot.slice_check reports the count per program). `decode_layer_xla_bytes_prefetched` keeps the
  layer's figure with the prefetch, for comparison."""
  twin = dataclasses.replace(model_cfg, num_layers=1)
  fn, args = chunk_on(device, ecfg, twin)
  with qwen.unrolled_layers():
    chunk = _cost(fn, args, NO_PREFETCH)
  layer_fn, layer_args = programs.engine_layer_program(ecfg, model_cfg)
  layer_args = programs.placed(layer_args, jax.sharding.SingleDeviceSharding(device))
  layer = _cost(layer_fn, layer_args, NO_PREFETCH)
  prefetched = _cost(layer_fn, layer_args)
  xla = chunk["bytes"] + (model_cfg.num_layers - 1) * layer["bytes"]
  ideal = decode_ideal(ecfg, model_cfg)
  kernel_kv = ideal["kv"] if layer["mosaic"] else 0  # the XLA gather path is in XLA's count
  accessed = xla + kernel_kv
  return {
    "decode_bytes_per_step": accessed,
    "decode_xla_bytes_per_step": xla,
    "decode_layer_xla_bytes": layer["bytes"],
    "decode_layer_xla_bytes_raw": layer["raw"],
    "decode_layer_xla_bytes_prefetched": prefetched["bytes"],
    "decode_xla_bytes_raw": chunk["raw"] + (model_cfg.num_layers - 1) * layer["raw"],
    "decode_kernel_kv_bytes_per_step": kernel_kv,
    "decode_ideal_bytes_per_step": ideal["total"],
    "decode_ideal": ideal,
    "decode_ratio": round(accessed / ideal["total"], 3),
    "decode_slots": ecfg.max_slots,
    "compile_s_decode_account": round(
      chunk["seconds"] + layer["seconds"] + prefetched["seconds"], 1
    ),
  }


def chunk_on(device, ecfg: EngineConfig, model_cfg):
  """The engine's decode chunk (rl.aot.programs.engine_decode_program) with its arrays on `device`
  alone; the static arguments (steps, filtered) stay as they are."""
  one = jax.sharding.SingleDeviceSharding(device)
  fn, args = programs.engine_decode_program(ecfg, model_cfg)
  return fn, programs.placed(args[:3], one) + args[3:5] + programs.placed(args[5:], one)


def _cost(fn, args, options: dict | None = None) -> dict:
  t = time.perf_counter()
  compiled = fn.trace(*args).lower().compile(compiler_options=options)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  hlo = compiled.as_text()
  fix = inplace_scatter_charge(hlo)
  return {
    "bytes": float(cost["bytes accessed"]) - fix,
    "raw": float(cost["bytes accessed"]),
    "inplace_fix": fix,
    "seconds": time.perf_counter() - t,
    "mosaic": hlo.count(MOSAIC),
  }


_COMP = re.compile(r"^%?([\w.\-]+) .*\{$")
_ROOT_SCATTER = re.compile(
  r"^\s*ROOT %[\w.\-]+ = (\w+\[[0-9,]*\])\S* scatter\(%([\w.\-]+), %[\w.\-]+, %([\w.\-]+)\)"
)
_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[0-9,]*\])")


def inplace_scatter_charge(hlo: str) -> float:
  """What XLA's cost model charges fusions rooted at an in-place scatter beyond the scatter's own
  rule (3 x its updates): such a fusion is billed its whole operand — the KV pool, every layer —
  though the pool is donated, aliased and written in place (memory_analysis: no pool-sized
  temporary). The pool operand's bytes less the updates', per call of each such fusion."""
  shapes, fix, current = {}, {}, None
  for line in hlo.splitlines():
    m = _COMP.match(line) if line and not line.startswith(" ") else None
    if m:
      current, shapes = m.group(1), {}
      continue
    d = _DEF.match(line)
    if d:
      shapes[d.group(1)] = d.group(2)
    r = _ROOT_SCATTER.match(line)
    if r and current and r.group(2).startswith("param"):
      fix[current] = _array_bytes(r.group(1)) - 3 * _array_bytes(shapes.get(r.group(3), "f32[]"))
  calls = re.findall(r"calls=%([\w.\-]+)", hlo)
  return float(sum(max(fix[c], 0) for c in calls if c in fix))


def _array_bytes(shape: str) -> int:
  dtype, dims = shape.split("[")
  return ITEM_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims[:-1].split(",") if d)


def decode_ideal(ecfg: EngineConfig, model_cfg) -> dict[str, int]:
  """One decode step's floor: every weight once in the compute dtype, the KV of every slot at the
  compiled context once (max_seq_len rounded to pages), the [slots, V] f32 logits once."""
  _, state = programs.rollout_state(model_cfg)
  weights = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
  cache_dt = jnp.dtype(ecfg.cache_dtype or model_cfg.dtype)
  kv_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.dim_per_head
  context = ecfg.pages_per_seq * ecfg.page_size
  kv = ecfg.max_slots * context * kv_token * cache_dt.itemsize
  logits = ecfg.max_slots * model_cfg.vocab_size * 4
  return {"weights": weights, "kv": kv, "logits": logits, "total": weights + kv + logits}
