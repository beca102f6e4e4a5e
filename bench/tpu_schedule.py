"""Read libtpu's scheduled code: per Mosaic kernel, the bundles a grid step issues and its spills.

A TPU TensorCore is statically scheduled: the compiler packs instructions into VLIW bundles and the
core issues one bundle per cycle unless it stalls on memory. So the bundles one grid step executes,
times the grid steps, over the clock, is a floor on the kernel's compute time (*modelled*, never
measured), and the spill traffic the register allocator added is visible as vector loads / stores on
``#allocationN_spill`` buffers.

libtpu writes the scheduled code when ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR`` is set before jax
starts (a subprocess: :func:`dump_env`); per compiled program it writes, among ~70 pass dumps,

* ``<id>-<name>-NN-schedule-analysis_final_bundles.txt``: ``total scheduled bundles: N`` and the HLO
  instruction (a Mosaic kernel is ``custom-call(...) custom_call_target="tpu_custom_call"``);
* ``<id>-<name>-NN-final_bundles.txt``: one bundle per line, ``<addr> <marker>: <'>' x depth>
  { op ;; op ... }``, markers ``LB`` (loop body start), ``LH``, ``LE``, ``PB``, ``PF``, ``CT``; loop
  depth as the count of ``>``; a loop's exit compare carries ``/* loop exit test */`` (its bound is a
  literal when the trip count is static); the grid's window comments carry
  ``iteration_bounds: (64, 75)``.

That format is libtpu's internal one, so everything here parses defensively: whatever cannot be read
is ``None`` with the reason in ``KernelSchedule.problems``, never a guessed number. Tested on the
dumps of libtpu 0.0.42.1 (jax 0.10.2) and 0.0.48.1 (jax 0.11.2) (``TESTED_LIBTPU``; both schedule
the qwen2.5-8k loss kernels within 0.5 % of each other); tests/kernels/test_tpu_schedule.py runs on
trimmed excerpts committed under tests/kernels/data/tpu_schedule/ and one live compile when libtpu is
installed.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

TESTED_LIBTPU = ("0.0.42.1", "0.0.48.1")

_ADDR = re.compile(r"^\s*(0x[0-9a-fA-F]+|\d+)\s+([A-Z]{2})?:\s*(>*)\s*\{")
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_TOTAL = re.compile(r"total scheduled bundles:\s*(\d+)")
_BOUNDS = re.compile(r"iteration_bounds:\s*\(([\d,\s]*)\)")
_PRED = r"(?:\(!?%\w+\),\s*)?"  # an instruction's optional predicate operand: (%p12) / (!%p12)
_EXIT = re.compile(
  rf"scmp\.(ge|gt|eq)\.s32[.\w]*\s+{_PRED}(%\w+),\s*(-?\d+)\s*/\*\s*loop exit test"
)
_SPILL = re.compile(r"=\s*(v|s)(ld|st)\b[.\w]*\s*\[(?:vmem|smem):\[#allocation\d+_spill")
_VLOAD = re.compile(r"=\s*vld\b")
_FILE = re.compile(
  r"^\d+-(?P<name>.+)-(?P<pass>\d+)-"
  r"(?P<kind>schedule-analysis_final_bundles|final_bundles|post-delay-converter|original)\.txt$"
)
_VMEM = re.compile(r"space=vmem, size = 0x([0-9a-fA-F]+)")


@dataclasses.dataclass
class Loop:
  """One loop of the scheduled code: where its body starts, its own bundles (nested loops' excluded),
  and its trip count when the exit test compares with a literal (else None)."""

  start: int  # bundle index of its LB bundle
  depth: int
  bundles: int = 0
  trip: int | None = None
  children: list[Loop] = dataclasses.field(default_factory=list)
  spill_loads: int = 0
  spill_stores: int = 0

  def issued(self) -> tuple[int, int, int, int]:
    """(bundles, vector spill loads, stores, loops of unknown trip) one iteration issues, nested
    loops weighted by their trip counts (an unknown trip counts once)."""
    b, ld, st, unknown = self.bundles, self.spill_loads, self.spill_stores, 0
    for c in self.children:
      cb, cl, cs, cu = c.issued()
      k = c.trip if c.trip is not None else 1
      b, ld, st = b + k * cb, ld + k * cl, st + k * cs
      unknown += cu + (c.trip is None)
    return b, ld, st, unknown


@dataclasses.dataclass
class KernelSchedule:
  """One Mosaic kernel's static schedule (see the module docstring); None = not readable here."""

  name: str
  total_bundles: int | None = None  # the schedule analysis' total (the whole program)
  grid: tuple[int, ...] | None = None  # from the window comments' iteration_bounds
  grid_loop_trip: int | None = None  # the outer loop's exit bound (grid steps + pipeline stages)
  step_bundles: int | None = None  # bundles one grid step issues (grid loop body, nested x trips)
  loops: list[dict] = dataclasses.field(default_factory=list)  # nested: start, depth, bundles, trip
  unknown_trips: int = 0  # nested loops whose trip count is not a literal (counted once per step)
  vector_loads: int | None = None  # static vld count in the code
  spill_loads: int | None = None  # static vector spill reloads (vld on _spill) in the code
  spill_stores: int | None = None
  step_spill_loads: int | None = None  # per grid step, nested loops weighted by trips
  step_spill_stores: int | None = None
  vmem_bytes: int | None = None  # VMEM the kernel's allocations take (blocks, scratch, spill slots)
  problems: list[str] = dataclasses.field(default_factory=list)

  @property
  def grid_steps(self) -> int | None:
    return math.prod(self.grid) if self.grid else None

  def compute_bundles(self) -> int | None:
    """Bundles the whole kernel issues: step bundles x grid steps plus the code outside the loop."""
    if self.step_bundles is None or self.total_bundles is None:
      return None
    steps = self.grid_steps or 1
    outside = max(0, self.total_bundles - self._grid_body_static())
    return outside + self.step_bundles * steps

  def _grid_body_static(self) -> int:
    def static(d):
      return d["bundles"] + sum(static(c) for c in d["children"])

    return static(self.loops[0]) if self.loops else 0

  def modelled_seconds(self, clock_hz: float) -> float | None:
    """Issue time at ``clock_hz`` with no stalls: a floor on compute time (modelled)."""
    b = self.compute_bundles()
    return None if b is None else b / clock_hz


def _bundles(text: str) -> list[tuple[str | None, int, str]]:
  """(marker, depth, body) per bundle; a bundle's comments may span lines (dropped)."""
  out, cur = [], None
  for line in text.split("\n"):
    m = _ADDR.match(line)
    if m:
      if cur is not None:
        out.append(cur)
      cur = [m.group(2), len(m.group(3)), line[m.end() :]]
    elif cur is not None:
      cur[2] += "\n" + line
  if cur is not None:
    out.append(cur)
  return [(mk, d, body) for mk, d, body in out]


_REGION = re.compile(r"Start region (\d+)")
_BACK = re.compile(r"sbr\.rel\s*(?:\(!?(%\w+)\))?[^;}]*target = \$region(\d+)")
DELAY_SLOTS = (
  4  # bundles after a branch that still issue (read off the dumps: a loop's body runs on)
)


def _loop_spans(bundles, problems) -> list[tuple[int, int, int, str | None]]:
  """(start, end inclusive, depth, the back branch's predicate) per loop: from its LB bundle to the branch back to the region the
  LB starts, plus the delay slots after it (bundles still inside, or empty, at most DELAY_SLOTS).
  Depth marks alone do not delimit a loop: the scheduler moves predicated outer-loop work into an
  inner loop's last bundles. Without a back branch a loop ends where the depth drops (noted)."""
  spans = []
  for i, (marker, depth, body) in enumerate(bundles):
    if marker != "LB":
      continue
    regions = set(_REGION.findall(body))
    end, pred = None, None
    for k in range(i, len(bundles)):
      back = [b for b in _BACK.finditer(_COMMENT.sub("", bundles[k][2])) if b.group(2) in regions]
      if back:
        end, pred = k, back[0].group(1)
        break
    if end is None:
      problems.append(f"loop at bundle {i}: no branch back to its region; ended where depth drops")
      end = i
      while end + 1 < len(bundles) and (bundles[end + 1][1] >= depth or _empty(bundles[end + 1])):
        end += 1
    else:
      for _ in range(DELAY_SLOTS):
        nxt = end + 1
        if nxt >= len(bundles) or bundles[nxt][0] == "LB":  # the next loop starts: no more slots
          break
        if bundles[nxt][1] >= depth or _empty(bundles[nxt]):
          end = nxt
    spans.append((i, end, depth, pred))
  return spans


def _empty(bundle) -> bool:
  return not bundle[2].split("}", 1)[0].strip()


def _loops(bundles, problems, text: str) -> list[Loop]:
  """The loop forest by span nesting; each bundle counts (bundles, spills, exit test) for its
  innermost loop."""
  roots: list[Loop] = []
  stack: list[tuple[Loop, int]] = []
  owner: dict[int, Loop] = {}
  for start, end, depth, pred in _loop_spans(bundles, problems):
    while stack and stack[-1][1] < start:
      stack.pop()
    loop = Loop(start=start, depth=depth)
    (stack[-1][0].children if stack else roots).append(loop)
    stack.append((loop, end))
    for k in range(start, end + 1):
      owner[k] = loop  # a nested loop, visited later, takes its own bundles over
    # the exit test is the compare that sets the back branch's predicate (the scheduler may place
    # it in a nested loop's bundles); the grid loop's trip is not needed (iteration_bounds): no notes
    test = pred and re.search(rf"{re.escape(pred)} = {_EXIT.pattern}", text)
    if test:
      loop.trip = _trip(text, test.group(2), int(test.group(3)), problems if depth > 1 else [])
    elif depth > 1:
      problems.append(f"loop at bundle {start}: no exit test with a literal bound")
  for k, loop in owner.items():
    body = bundles[k][2]
    loop.bundles += 1
    code = _COMMENT.sub("", body) if "/*" in body else body
    for m in _SPILL.finditer(code):
      if m.group(1) == "v":
        loop.spill_loads += m.group(2) == "ld"
        loop.spill_stores += m.group(2) == "st"
  return roots


def _trip(text: str, counter: str, bound: int, problems) -> int | None:
  """Iterations of a loop whose exit test is ``counter >= bound``: the counter is ``sadd.s32 step,
  phi`` and the phi starts from ``smov start`` (an unrolled loop steps by its unroll factor); read
  off the code, else None (noted)."""
  step_def = re.search(rf"{re.escape(counter)} = sadd\.s32 {_PRED}(-?\d+), (%\w+)", text)
  if step_def is None or int(step_def.group(1)) <= 0:
    problems.append(f"loop counter {counter}: no constant increment; trip count unknown")
    return None
  step, phi = int(step_def.group(1)), step_def.group(2)
  start = 0
  phi_def = re.search(rf"{re.escape(phi)} = sphi {_PRED}(%\w+), ", text)
  init = phi_def and re.search(rf"{re.escape(phi_def.group(1))} = smov {_PRED}(-?\d+)\b", text)
  if init:
    start = int(init.group(1))
  else:
    problems.append(f"loop counter {counter}: start not a literal, taken as 0")
  return max(0, -(-(bound - start) // step))


def parse_kernel(name: str, bundles_text: str | None, analysis_text: str | None) -> KernelSchedule:
  """A kernel's schedule from its two dump files' text (either may be None: what it gives is None)."""
  k = KernelSchedule(name=name)
  if analysis_text is None:
    k.problems.append("no schedule-analysis_final_bundles file")
  else:
    m = _TOTAL.search(analysis_text)
    if m:
      k.total_bundles = int(m.group(1))
    else:
      k.problems.append("schedule analysis has no 'total scheduled bundles'")
  if bundles_text is None:
    k.problems.append("no final_bundles file")
    return k
  bundles = _bundles(bundles_text)
  if not bundles:
    k.problems.append("final_bundles: no bundle lines in the expected format")
    return k
  m = _BOUNDS.search(bundles_text)
  if m and m.group(1).strip():
    k.grid = tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)
  code = [_COMMENT.sub("", b) for _, _, b in bundles]
  k.vector_loads = sum(len(_VLOAD.findall(c)) for c in code)
  spills = [(m.group(1), m.group(2)) for c in code for m in _SPILL.finditer(c)]
  k.spill_loads = sum(1 for kind, op in spills if kind == "v" and op == "ld")
  k.spill_stores = sum(1 for kind, op in spills if kind == "v" and op == "st")
  roots = _loops(bundles, k.problems, bundles_text)
  k.loops = [dataclasses.asdict(r) for r in roots]
  if not roots:
    if k.grid and k.grid_steps > 1:
      k.problems.append(f"grid {k.grid} but no loop (LB) marker found")
    else:  # no grid: the whole program is one step
      k.step_bundles = k.total_bundles if k.total_bundles is not None else len(bundles)
      k.step_spill_loads, k.step_spill_stores = k.spill_loads, k.spill_stores
    return k
  if len(roots) > 1:
    k.problems.append(f"{len(roots)} top-level loops: the first is taken as the grid loop")
  grid_loop = roots[0]
  k.grid_loop_trip = grid_loop.trip
  k.step_bundles, k.step_spill_loads, k.step_spill_stores, k.unknown_trips = grid_loop.issued()
  if k.unknown_trips:
    k.problems.append(
      f"{k.unknown_trips} nested loop(s) without a literal trip count, counted once per step: "
      "step_bundles is a lower bound"
    )
  if k.grid is None:
    k.problems.append("no iteration_bounds in the window comments: grid unknown")
  return k


def _is_mosaic(name: str, analysis_text: str) -> bool:
  """Whether the program ``name`` is itself a Mosaic kernel (the top-level program also lists them)."""
  entry = re.search(rf"%{re.escape(name)} = [^\n]*?custom-call\(", analysis_text)
  return entry is not None and "tpu_custom_call" in analysis_text[entry.end() :].split("\n", 1)[0]


def read_dump(directory: str | pathlib.Path, mosaic_only: bool = True) -> list[KernelSchedule]:
  """Every (Mosaic) kernel of a dump directory, in file order; [] when none is found."""
  d = pathlib.Path(directory)
  found: dict[tuple[str, str], dict[str, pathlib.Path]] = {}
  for f in sorted(d.glob("*.txt")):
    m = _FILE.match(f.name)
    if m is None:
      continue
    prog = f.name.split("-", 1)[0]
    found.setdefault((prog, m.group("name")), {})[m.group("kind")] = f
  out = []
  for (_, name), files in found.items():
    analysis = files.get("schedule-analysis_final_bundles")
    analysis_text = analysis.read_text(errors="replace") if analysis else None
    if mosaic_only and (analysis_text is None or not _is_mosaic(name, analysis_text)):
      continue
    bundles = files.get("final_bundles")
    k = parse_kernel(name, bundles.read_text(errors="replace") if bundles else None, analysis_text)
    allocs = files.get("post-delay-converter") or files.get("original")
    k.vmem_bytes = vmem_allocated(allocs.read_text(errors="replace")) if allocs else None
    if k.vmem_bytes is None:
      k.problems.append("no VMEM allocation listing (post-delay-converter / original pass)")
    out.append(k)
  return out


def vmem_allocated(text: str) -> int | None:
  """Bytes of the ``space=vmem`` allocations a pass dump lists (the last allocation passes list the
  spill slots too); None when it lists none."""
  sizes = [int(x, 16) for x in _VMEM.findall(text)]
  return sum(sizes) if sizes else None


def dump_env(directory: str | pathlib.Path, base: dict | None = None) -> dict:
  """The environment of a subprocess whose libtpu dumps its scheduled code to ``directory``
  (libtpu reads ``LIBTPU_INIT_ARGS`` once, when jax first loads it)."""
  import os

  env = dict(os.environ if base is None else base)
  flag = f"--xla_jf_dump_to={directory}"
  env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + " " + flag).strip()
  env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # deviceless compiles share the host's libtpu
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def describe(k: KernelSchedule, clock_hz: float | None = None) -> str:
  """One line per kernel: what a report row shows."""
  if k.step_bundles is None:
    return f"{k.name}: schedule not readable ({'; '.join(k.problems) or 'unknown'})"
  t = k.modelled_seconds(clock_hz) if clock_hz else None
  timing = f", modelled {t * 1e3:.3f} ms at {clock_hz / 1e9:.2f} GHz" if t is not None else ""
  return (
    f"{k.name}: grid {k.grid}, {k.step_bundles} bundles per step, spills per step "
    f"{k.step_spill_loads} loads / {k.step_spill_stores} stores{timing}"
  )
