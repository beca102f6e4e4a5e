"""How often each part of a compiled program runs: while loops' trip counts read off optimized HLO.

XLA's cost model (``compiled.cost_analysis()``) and the Mosaic kernels' static schedules
(:mod:`bench.tpu.schedule`) both count a loop body once: a ``lax.scan`` over 8 chunks (the fused
head's ``chunked`` path) is charged one chunk's matmuls and one call of each kernel inside it. This
module reads the compiled HLO text (``compiled.as_text()``) of a program:

* each ``while``'s trip count, from ``backend_config``'s ``known_trip_count`` where XLA wrote it,
  else from its condition (``compare(get-tuple-element(i), constant(C)), direction=LT``), the
  counter's initial constant in the loop's init tuple and its step in the body (``add(i, constant)``);
  a loop it cannot read is counted once and reported (:attr:`Loops.unknown`);
* each computation's multiplicity: how many times one run of the program runs it (the product of
  the trip counts of the loops around it, summed over its call sites);
* each Mosaic kernel's (``tpu_custom_call``) multiplicity, by its instruction name: the name
  libtpu's dump gives the kernel's schedule. Calls whose kernels are the same program (the same
  serialized Mosaic module in ``backend_config``: the fused head's middle row superblocks) are
  compiled once and dumped under one of their names, so :attr:`Loops.same_program` maps each call
  to the first call of its program and the model charges that schedule for every call;
* the matmul flops (dots) that a count-once model leaves out: ``(multiplicity - 1) x flops`` of each
  dot in a loop body;
* a conditional's fallback kernels: where exactly one branch of a ``conditional`` runs Mosaic
  kernels and every one of them is named ``*_fallback*``, that branch runs only when the program's
  fast path flags its input (the vocab-tiled loss statistics' exact kernel: rows whose one-sweep
  sums overflow). Its kernels are charged 0 runs (the best case: no input flagged) and listed in
  :attr:`Loops.fallback` with the runs they would take, so a report says what it left out.

Optimized HLO text is XLA's dump format, not an API: whatever is not read is reported, never guessed.
"""

from __future__ import annotations

import dataclasses
import math
import re

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(, .*)?$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([0-9,]*)\]")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")  # fmt: skip
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_KNOWN_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_DIRECTION = re.compile(r"direction=(LT|GT|LE|GE|NE)")


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  op: str
  args: list[str]
  attrs: str
  root: bool


@dataclasses.dataclass
class Loops:
  """What a compiled program's loops do to its counts (see the module docstring)."""

  trips: list[int | None] = dataclasses.field(default_factory=list)  # per while, in text order
  kernels: dict[str, int] = dataclasses.field(default_factory=dict)  # Mosaic call -> runs
  # Mosaic call -> the first call (text order) whose kernel is the same program
  same_program: dict[str, str] = dataclasses.field(default_factory=dict)
  uncounted_dot_flops: float = 0.0  # dot flops in loop bodies beyond their first trip
  fallback: dict[str, int] = dataclasses.field(default_factory=dict)  # not charged: would-be runs
  unknown: list[str] = dataclasses.field(default_factory=list)  # loops whose trip was not read

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def computations(hlo: str) -> dict[str, list[Instr]]:
  """{computation: its instructions} of optimized HLO text, in text order (ENTRY last)."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" ") and "(" in line:
      cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      comps[cur] = []
    elif cur is not None and (m := _INSTR.match(line)):
      args = re.findall(r"%([\w.\-]+)", m.group(4))
      attrs = m.group(4) if m.group(3) in ("parameter", "constant") else m.group(5) or ""
      comps[cur].append(Instr(m.group(1), m.group(2), m.group(3), args, attrs, "ROOT" in line[:8]))
  return comps


def _dims(shape: str) -> list[int]:
  m = _SHAPE.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _through(by_name: dict, name: str | None) -> Instr | None:
  """The instruction ``name`` names, looking through copies and bitcasts (the scheduler copies a
  loop counter between its uses)."""
  instr = by_name.get(name)
  while instr is not None and instr.op in _VIEWS and instr.args:
    instr = by_name.get(instr.args[0])
  return instr


_VIEWS = ("copy", "bitcast", "convert")


def _constant(instr: Instr | None) -> int | None:
  if instr is None or instr.op != "constant" or _dims(instr.shape) != []:
    return None
  try:
    return int(instr.attrs.strip())
  except ValueError:
    return None


def trip_count(comps: dict, caller: list[Instr], loop: Instr) -> int | None:
  """Trips of ``loop`` (a while instruction of computation ``caller``), or None when not readable."""
  known = _KNOWN_TRIP.search(loop.attrs)
  if known:
    return int(known.group(1))
  cond = re.search(r"condition=%([\w.\-]+)", loop.attrs)
  body = re.search(r"body=%([\w.\-]+)", loop.attrs)
  if not (cond and body and cond.group(1) in comps and body.group(1) in comps):
    return None
  by_name = {i.name: i for i in comps[cond.group(1)]}
  root = next((i for i in comps[cond.group(1)] if i.root), None)
  direction = _DIRECTION.search(root.attrs) if root is not None and root.op == "compare" else None
  if direction is None or len(root.args) != 2:
    return None
  counter, bound = _through(by_name, root.args[0]), _constant(_through(by_name, root.args[1]))
  if counter is None or counter.op != "get-tuple-element" or bound is None:
    return None
  index = int(re.search(r"index=(\d+)", counter.attrs).group(1))
  local = {i.name: i for i in caller}
  init_tuple = _through(local, loop.args[0]) if loop.args else None
  if init_tuple is None or init_tuple.op != "tuple" or index >= len(init_tuple.args):
    return None
  start = _constant(_through(local, init_tuple.args[index]))
  step = _step(comps[body.group(1)], index)
  if start is None or step is None:
    return None
  op = direction.group(1)
  if op in ("LT", "LE") and step > 0:
    return max(0, -(-(bound + (op == "LE") - start) // step))
  if op in ("GT", "GE") and step < 0:
    return max(0, -(-(start - bound - (op == "GE")) // -step))
  return None


def _step(body: list[Instr], index: int) -> int | None:
  """The constant the body adds to tuple element ``index`` (its loop counter), else None."""
  by_name = {i.name: i for i in body}
  root = next((i for i in body if i.root), None)
  if root is None or root.op != "tuple" or index >= len(root.args):
    return None
  upd = _through(by_name, root.args[index])
  if upd is None or upd.op != "add" or len(upd.args) != 2:
    return None
  for a, b in (upd.args, upd.args[::-1]):
    gte, c = _through(by_name, a), _constant(_through(by_name, b))
    if gte is not None and gte.op == "get-tuple-element" and f"index={index}" in gte.attrs:
      return c
  return None


def _callees(instr: Instr) -> list[tuple[str, str]]:
  out = [(kind, name) for kind, name in _CALLS.findall(instr.attrs)]
  for group in _BRANCHES.findall(instr.attrs):
    out += [("branch", n.strip().lstrip("%")) for n in group.split(",") if n.strip()]
  return out


def _dot_flops(instr: Instr, shapes: dict[str, str]) -> float:
  """2 x output elements x contracted size of a dot, or of a convolution (what XLA:TPU lowers a dot
  to: ``dim_labels=bf_io->bf``, the lhs feature dimension contracted, times its window); else 0."""
  if instr.op not in ("dot", "convolution") or not instr.args or instr.args[0] not in shapes:
    return 0.0
  lhs = _dims(shapes[instr.args[0]])
  if instr.op == "dot":
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    contract = [lhs[int(d)] for d in m.group(1).split(",") if d] if m else []
  else:
    labels = re.search(r"dim_labels=(\w+)_", instr.attrs)
    if labels is None or "f" not in labels.group(1) or len(labels.group(1)) != len(lhs):
      return 0.0
    window = re.search(r"window=\{size=([\dx]+)", instr.attrs)
    groups = re.search(r"feature_group_count=(\d+)", instr.attrs)
    contract = [lhs[labels.group(1).index("f")] // (int(groups.group(1)) if groups else 1)]
    contract += [int(w) for w in window.group(1).split("x")] if window else []
  return 2.0 * math.prod(_dims(instr.shape)) * math.prod(contract)


def _reachable(comps: dict, root: str) -> set[str]:
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name in comps and name not in seen:
      seen.add(name)
      todo += [callee for i in comps[name] for _, callee in _callees(i)]
  return seen


def _is_kernel(instr: Instr) -> bool:
  return instr.op == "custom-call" and "tpu_custom_call" in instr.attrs


def _fallback_branches(comps: dict) -> set[str]:
  """The computations of every conditional branch that alone among its conditional's branches runs
  Mosaic kernels, all named ``*_fallback*`` (see the module docstring)."""
  out: set[str] = set()
  for instrs in comps.values():
    for instr in instrs:
      if instr.op != "conditional":
        continue
      branches = [_reachable(comps, c) for kind, c in _callees(instr) if kind != "condition"]
      kernels = [[i.name for c in b for i in comps[c] if _is_kernel(i)] for b in branches]
      running = [b for b, k in zip(branches, kernels) if k]
      if len(running) == 1 and all("_fallback" in k for ks in kernels for k in ks):
        out |= running[0]
  return out


def read(hlo: str) -> Loops:
  """The loops of one compiled program (see the module docstring)."""
  comps = computations(hlo)
  out = Loops()
  mult = {name: 0 for name in comps}
  rare = _fallback_branches(comps)
  order = list(comps)[::-1]  # callers print after their callees: ENTRY first from the end
  if order:
    mult[order[0]] = 1
  for name in order:
    for instr in comps[name]:
      trip = None
      if instr.op == "while":
        trip = trip_count(comps, comps[name], instr)
        out.trips.append(trip)
        if trip is None:
          out.unknown.append(f"{name}/{instr.name}")
      for kind, callee in _callees(instr):
        if callee in mult:
          times = (trip if trip is not None else 1) if kind in ("body", "condition") else 1
          mult[callee] += mult[name] * times
  first: dict[str, str] = {}  # a kernel's program (its backend_config) -> its first call
  for name, instrs in comps.items():
    shapes = {i.name: i.shape for i in instrs}
    for instr in instrs:
      if _is_kernel(instr):
        if name in rare:
          out.fallback[instr.name] = out.fallback.get(instr.name, 0) + mult[name]
          out.kernels.setdefault(instr.name, 0)
        else:
          out.kernels[instr.name] = out.kernels.get(instr.name, 0) + mult[name]
        program = instr.attrs.partition("backend_config=")[2]
        out.same_program[instr.name] = first.setdefault(program, instr.name) if program else instr.name  # fmt: skip
      extra = max(mult[name] - 1, 0)
      if extra:
        out.uncounted_dot_flops += extra * _dot_flops(instr, shapes)
  return out
