"""The byte account of one rollout decode step: what XLA says the compiled decode chunk reads and
writes per step, next to the floor (weights once in the compute dtype + the KV the step attends to +
the logits). Compile only: the model and cache are abstract (`jax.ShapeDtypeStruct`), nothing runs,
so it works on CPU at the real Qwen2.5-0.5B shape.

    python -m bench.rollout.byte_account                        # Qwen2.5-0.5B, 128 slots x 768, paged + dense

What XLA's cost model counts (`compiled.cost_analysis()["bytes accessed"]`, HloCostAnalysis):
  * every instruction of a non-fused computation is charged its operands' and its result's bytes; a
    fusion is one instruction (its internals are free), so fusing is what removes intermediate traffic;
  * a while loop's body is counted ONCE (its trip count is not applied): the decode chunk's count is
    one decode step plus the chunk's out-of-loop work (a few [steps, S] outputs); the decoder's own
    layer scan would be billed one layer of L, so `account` compiles the layers one by one
    (`rl.model.qwen.unrolled_layers`: the same math, each layer's weights a static slice);
  * an unfused scatter is charged 3 x its updates + indices and a dynamic-update-slice its update (they
    run in place), an unfused gather its output + indices; but a FUSION around a scatter or gather —
    and XLA:CPU wraps every scatter / gather in one — is charged the full operand (and, for a scatter,
    the full result): the whole KV pool per layer, read and written, although the scatter runs in
    place (memory_analysis shows no pool-sized temporary) and the gather touches B x context rows.
`account` reports the raw count and the count with those fusion operands charged by XLA's own
unfused rules (`inplace_fix`: the difference, found in the optimized HLO), with what the entry
computation is charged (work hoisted out of the loop, once per chunk) shared by the chunk's steps;
the ratio uses the latter. `breakdown` lists the largest charges by source op: where an excess is.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.model import qwen
from rl.model.cache import DenseKVCache
from rl.model.config import ModelConfig
from rl.rollout import steps
from rl.rollout.paged_cache import PagedKVCache

_DTYPE_BYTES = dict(
  pred=1, s8=1, u8=1, s16=2, u16=2, f16=2, bf16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8
)
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(, .*)?$")
# ops that only re-view or convert elementwise: a parameter reaching a gather / scatter through
# them is still read only where the gather / scatter touches it
_VIEW_OPS = {"bitcast", "bitcast-convert", "convert", "copy", "reshape"}


def _bytes(shape: str) -> int:
  return sum(
    _DTYPE_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    for dt, dims in _SHAPE.findall(shape)
  )


def _computations(hlo: str) -> dict[str, dict[str, tuple[str, str, list[str]]]]:
  """{computation: {instruction: (result shape, opcode, operand names)}} of optimized HLO text."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):
      cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      comps[cur] = {}
    elif cur is not None and (m := _INSTR.match(line)):
      name, shape, op, args = m.group(1), m.group(2), m.group(3), m.group(4)
      attrs = args if op == "parameter" else m.group(5) or ""  # a parameter keeps its index
      comps[cur][name] = (shape, op, re.findall(r"%([\w.\-]+)", args), attrs)
  return comps


def _users(comp) -> dict[str, list[str]]:
  users = {n: [] for n in comp}
  for n, (_, _, args, _) in comp.items():
    for a in args:
      users.setdefault(a, []).append(n)
  return users


def _touched(comp, users, name: str, slices: bool = False) -> int | None:
  """Bytes of parameter `name` a fused gather / in-place scatter really touches, when every use of it
  is one (through view ops); None when any other use reads it whole."""
  total, elem = 0, _DTYPE_BYTES[_SHAPE.search(comp[name][0]).group(1)]
  for u in users.get(name, []):
    shape, op, args, _ = comp[u]
    if op in _VIEW_OPS:
      sub = _touched(comp, users, u, slices)
      if sub is None:
        return None
      total += sub
    elif (op == "gather" and args[0] == name) or (
      slices and op in ("slice", "dynamic-slice") and args[0] == name
    ):  # charged its output (in the parameter's dtype)
      total += _bytes(shape) // _DTYPE_BYTES[_SHAPE.search(shape).group(1)] * elem
    elif op == "scatter" and args[0] == name:  # in place: charged its updates
      total += _bytes(comp[args[2]][0])
    else:
      return None
  return total


def inplace_fix(hlo: str) -> int:
  """Bytes XLA's cost model charges fusions around gathers and in-place scatters beyond XLA's own
  rules for the unfused ops (see the module docstring)."""
  comps = _computations(hlo)
  fix = 0
  for comp in comps.values():
    for shape, op, args, attrs in comp.values():
      called = re.search(r"calls=%([\w.\-]+)", attrs)
      if op == "fusion" and called and called.group(1) in comps:
        fix += _fusion_fix(comps[called.group(1)], shape, len(args), slices=True)
  return fix


def _fusion_fix(inner, shape: str, num_args: int, slices: bool = False) -> int:
  """One fusion's overcharge: full-size parameters that feed only gathers / in-place scatters, and a
  scatter result that is the updated operand."""
  users, fix = _users(inner), 0
  for pname, (pshape, op, _, index) in inner.items():
    if op == "parameter" and int(index) < num_args:
      touched = _touched(inner, users, pname, slices)
      if touched is not None:
        fix += max(_xla_charged(inner, users, pname, pshape) - touched, 0)
  root = _root(inner)
  if root is not None and inner[root][1] == "scatter":  # the result is the updated operand
    fix += _bytes(shape) - _bytes(inner[inner[root][2][2]][0])
  return fix


def _xla_charged(inner, users, pname: str, pshape: str) -> int:
  """What HloCostAnalysis charges a fusion parameter: the slice outputs when every user is a direct
  (dynamic-)slice of it, else its whole size. A slice reached through a view op (bitcast, reshape)
  is charged whole, which is the overcharge `_touched` corrects (e.g. one layer of stacked weights)."""
  charged = 0
  for u in users.get(pname, []):
    shape, op, args, _ = inner[u]
    if op not in ("slice", "dynamic-slice") or args[0] != pname:
      return _bytes(pshape)
    charged += _bytes(shape)
  return charged or _bytes(pshape)


def _root(comp) -> str | None:
  root = next(reversed(comp), None)  # ROOT is printed last
  while root is not None and comp[root][1] in _VIEW_OPS - {"convert"}:
    root = comp[root][2][0]
  return root


@dataclasses.dataclass(frozen=True)
class StepAccount:
  """Bytes per decode step (see the module docstring for what XLA counts)."""

  engine: str
  batch: int
  context: int  # tokens of KV each row's step attends over (the compiled capacity)
  weights: int  # all weights once, in the compute dtype
  kv: int  # batch x context tokens of K and V, every layer, in the cache dtype
  logits: int  # [batch, V] f32 written once
  xla_bytes: float  # compiled.cost_analysis()["bytes accessed"] of the chunk
  inplace_fix: int  # XLA's charge for fused gathers / in-place scatters beyond its unfused rules
  outside: int  # of xla_bytes - inplace_fix: charged once per chunk, outside the step loop
  steps: int  # decode steps per chunk (steps_per_sync): `outside` is shared by that many steps
  temp_bytes: int  # memory_analysis(): scratch the chunk allocates
  cache_bytes: int  # the whole KV cache / pool
  compile_s: float
  top: tuple = ()  # `breakdown`: the largest charges, (bytes, opcode, source op)

  @property
  def ideal(self) -> int:
    return self.weights + self.kv + self.logits

  @property
  def accessed(self) -> float:
    """Per step: the loop body (XLA counts it once) + this step's share of the out-of-loop work."""
    return self.xla_bytes - self.inplace_fix - self.outside + self.outside / self.steps

  @property
  def ratio(self) -> float:
    return self.accessed / self.ideal

  def row(self) -> dict:
    return dict(
      dataclasses.asdict(self), ideal=self.ideal, accessed=self.accessed, ratio=self.ratio
    )


def _abstract_state(cfg: ModelConfig, dtype):
  from rl.model.qwen import Qwen

  graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0))))
  if dtype is not None:  # what the engines pass: `steps.rollout_weights`, once per generate
    state = jax.eval_shape(lambda s: steps.rollout_weights(s, jnp.dtype(dtype)), state)
  return graphdef, state


def _abstract_cache(
  cfg: ModelConfig, engine: str, batch: int, context: int, page_size: int, dtype, dense_cache
):
  if engine == "dense":
    make = lambda: dense_cache.create(
      cfg.num_layers, batch, context, cfg.num_kv_heads, cfg.dim_per_head, dtype
    )
  else:
    pages = context // page_size
    make = lambda: PagedKVCache.create(
      cfg.num_layers, batch * pages + 1, page_size, cfg.num_kv_heads, cfg.dim_per_head, dtype
    ).with_table(jnp.zeros((batch, pages), jnp.int32))
  return jax.eval_shape(make)


def account(
  cfg: ModelConfig,
  engine: str = "paged",
  batch: int = 128,
  context: int = 768,
  page_size: int = 16,
  steps_per_sync: int = 16,
  weights_dtype: str | None = "compute",
  dense_cache=DenseKVCache,
) -> StepAccount:
  """Compile (never run) the engine's decode chunk for `batch` slots of `context` tokens and account
  one step. `weights_dtype`: "compute" (what the engines pass), None (the raw parameters: the per-step
  cast the engines used to run) or a dtype name. `dense_cache`: the dense engine's cache class
  (rl.model.cache.DenseKVCache; a test passes a variant to account another)."""
  if engine not in ("paged", "dense"):
    raise ValueError(f"engine must be 'paged' or 'dense', got {engine!r}")
  if context % page_size:
    raise ValueError(f"context={context} must be a multiple of page_size={page_size}")
  dt = cfg.compute_dtype
  graphdef, state = _abstract_state(cfg, dt if weights_dtype == "compute" else weights_dtype)
  cache = _abstract_cache(cfg, engine, batch, context, page_size, dt, dense_cache)
  sds = jax.ShapeDtypeStruct
  i32 = sds((batch,), jnp.int32)
  slots = dict(
    tokens=i32,
    positions=i32,
    generated=i32,
    budget=i32,
    stop_ids=sds((batch, 1), jnp.int32),
    base_keys=jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch)),
    temperature=sds((batch,), jnp.float32),
    top_k=i32,
    top_p=sds((batch,), jnp.float32),
  )
  t = time.perf_counter()
  with qwen.unrolled_layers():  # layer by layer: cost analysis bills a loop body once
    compiled = steps.decode_chunk.lower(
      graphdef, state, cache, steps_per_sync, False, **slots
    ).compile()
  compile_s = time.perf_counter() - t
  hlo = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  weights = sum(
    int(np.prod(x.shape)) * (dt.itemsize if jnp.issubdtype(x.dtype, jnp.floating) else x.itemsize)
    for x in jax.tree.leaves(state)
  )
  kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_per_head * dt.itemsize
  return StepAccount(
    engine=engine,
    batch=batch,
    context=context,
    weights=weights,
    kv=batch * context * kv_token,
    logits=batch * cfg.vocab_size * 4,
    xla_bytes=float(cost["bytes accessed"]),
    inplace_fix=inplace_fix(hlo),
    outside=outside_loop(hlo),
    steps=steps_per_sync,
    temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
    cache_bytes=sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in (cache.k, cache.v)),
    compile_s=compile_s,
    top=tuple(breakdown(hlo, 10)),
  )


def markdown(rows: list[StepAccount], step_s: dict | None = None) -> str:
  lines = [
    "| engine | batch x context | ideal GB | accessed GB (XLA raw) | ratio | temp GB | "
    "step ms (measured) |",
    "|---|---|---|---|---|---|---|",
  ]
  for a in rows:
    ms = (step_s or {}).get(a.engine)
    lines.append(
      f"| {a.engine} | {a.batch} x {a.context} | {a.ideal / 1e9:.3f} | {a.accessed / 1e9:.3f} "
      f"({a.xla_bytes / 1e9:.3f}) | {a.ratio:.2f}x | {a.temp_bytes / 1e9:.3f} | "
      f"{'-' if ms is None else f'{1e3 * ms:.2f}'} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  from rl.model import preset

  p = argparse.ArgumentParser(
    prog="python -m bench.rollout.byte_account", description=__doc__.split("\n")[0]
  )
  p.add_argument("--model", default="qwen2.5-0.5b")
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--context", type=int, default=768)
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--engine", action="append", choices=("paged", "dense"))
  p.add_argument("--raw-weights", action="store_true", help="pass the f32 parameters (the old way)")
  a = p.parse_args(argv)
  cfg = preset(a.model)
  rows = [
    account(
      cfg,
      e,
      a.batch,
      a.context,
      steps_per_sync=a.steps,
      weights_dtype=None if a.raw_weights else "compute",
    )
    for e in a.engine or ("paged", "dense")
  ]
  print(markdown(rows))
  return 0


def _charges(hlo: str):
  """(computation, bytes, opcode, source op) per instruction of the non-fused computations, by the
  rules of `accessed`: operands and result in full, fused gathers / in-place scatters by what they
  touch. Computations a fusion calls are charged at the call."""
  comps = _computations(hlo)
  called = set(re.findall(r"calls=%([\w.\-]+)", hlo))
  free = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call"}
  for cname, comp in comps.items():
    if cname in called:
      continue
    for shape, op, args, attrs in comp.values():
      if op in free:
        continue
      charge = _bytes(shape) + sum(_bytes(comp[a][0]) for a in args if a in comp)
      inner = re.search(r"calls=%([\w.\-]+)", attrs)
      if op == "fusion" and inner and inner.group(1) in comps:
        # slices too: XLA's fusion rule already charges a sliced parameter by its slice
        charge -= _fusion_fix(comps[inner.group(1)], shape, len(args), slices=True)
      src = re.search(r'op_name="([^"]*)"', attrs)
      yield cname, charge, op, re.sub(r"\.\d+|\d+", "", src.group(1).split("/")[-1] if src else "?")


def outside_loop(hlo: str) -> int:
  """Bytes charged in the entry computation, i.e. once per chunk, outside the step loop (what XLA
  hoisted out of it, the chunk's inputs and outputs)."""
  entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
  return int(sum(c for comp, c, _, _ in _charges(hlo) if comp == entry))


def breakdown(hlo: str, top: int = 15) -> list[tuple[float, str, str]]:
  """The largest charges grouped by (opcode, source op name): where an excess over the ideal comes
  from."""
  groups: dict[tuple[str, str], float] = {}
  for _, charge, op, src in _charges(hlo):
    groups[op, src] = groups.get((op, src), 0.0) + charge
  ranked = sorted(((v, k[0], k[1]) for k, v in groups.items()), reverse=True)
  return ranked[:top]


if __name__ == "__main__":
  raise SystemExit(main())
