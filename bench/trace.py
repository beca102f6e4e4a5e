"""Profiler traces: capture (`capture`) and inspection (`python -m bench.trace profiles/<run>`).

Capture writes what `jax.profiler.trace` writes — an XSpace (`*.xplane.pb`, for TensorBoard's profile
plugin / xprof), its Chrome-trace JSON (`*.trace.json.gz`) and a Perfetto trace — under
`profiles/<run>/plugins/profile/<time>/`. Inspection reads them with xprof's own converters (op table:
`framework_op_stats`) and the trace events jax wrote (phases, kernels, gaps); no protobuf parsing here.

Phases are `jax.profiler.TraceAnnotation`s named `grpo/...` (the loop's `rl.logging.metrics.StepTimer` and the
rollout engines emit `grpo/rollout`, `grpo/rollout/prefill`, `grpo/rollout/decode`, `grpo/update`, ...)
or `bench/<case>/<kernel|reference>` (the timed repeats of `python -m bench --profile`).

The update is one compiled function, so its split into loss forward, loss backward and optimizer comes
from the ops themselves: every executed op event names its HLO module and instruction, xprof's
graph_viewer gives each module's HLO with the JAX name-scope path of every instruction, and the train
step opens the scopes `rl.update.LOSS_SCOPE` / `OPTIMIZER_SCOPE` (backward ops sit under `transpose(`).
That split is in wall time: XLA:CPU runs independent ops on several threads at once, so their summed
per-thread times exceed the step's wall time; an instant k ops share counts 1/k to each (`wall_shares`).

`python -m bench.trace` sets `TF_CPP_MIN_LOG_LEVEL=3` (unless set) before jax and xprof load: xprof's
converters otherwise print absl errors about TensorFlow tool registrations that are not failures.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  # `python -m bench.trace` only, before jax / xprof load their C++ logging (it reads this once, at
  # load): xprof's converters log absl errors such as "No ProfileProcessor registered for tool:
  # tool_names ... Please update to the latest version of Tensorflow" on every call, then fall back
  # to the converter that works. Failures still surface as Python exceptions, which the summary
  # reports. `TF_CPP_MIN_LOG_LEVEL=0 python -m bench.trace ...` shows them all again.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import collections
import contextlib
import glob
import gzip
import json
import re
from collections.abc import Iterable, Sequence

import jax

from rl.logging.metrics import profiler_options
from rl.update import LOSS_SCOPE, OPTIMIZER_SCOPE

PHASE_PREFIX = "grpo/"  # the loop's phases, reported without the prefix
BENCH_PREFIX = "bench/"  # bench cases' timed repeats, reported by full name
# The Chrome-trace export keeps the first million events (the XSpace keeps all): a summary that reached
# this count saw only the start of the run.
TRACE_EVENT_CAP = 1_000_000


@contextlib.contextmanager
def capture(run_dir: str, python_frames: bool = False):
  """Profile the enclosed work into `run_dir` (open with `tensorboard --logdir run_dir`)."""
  os.makedirs(run_dir, exist_ok=True)
  with jax.profiler.trace(
    run_dir, create_perfetto_trace=True, profiler_options=profiler_options(python_frames)
  ):
    yield run_dir


def latest_session(run_dir: str) -> str:
  """The newest `plugins/profile/<time>` directory under `run_dir` (or `run_dir` itself if it is one)."""
  if glob.glob(os.path.join(run_dir, "*.xplane.pb")):
    return run_dir
  sessions = sorted(glob.glob(os.path.join(run_dir, "plugins", "profile", "*")))
  if not sessions:
    raise FileNotFoundError(
      f"no profile under {run_dir} (expected plugins/profile/<time>/*.xplane.pb)"
    )
  return sessions[-1]


def op_stats(session: str) -> list[dict]:
  """xprof's framework_op_stats table: one dict per op (host_or_device, type, operation, occurrences,
  total_time, total_self_time in microseconds, ...)."""
  from xprof.convert import raw_to_tool_data

  paths = sorted(glob.glob(os.path.join(session, "*.xplane.pb")))
  data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "framework_op_stats", {})
  tables = json.loads(data)
  rows = []
  for table in tables:
    cols = [c["id"] for c in table["cols"]]
    rows += [dict(zip(cols, (c.get("v") for c in row["c"]))) for row in table.get("rows", [])]
  return [r for r in rows if r.get("operation") not in (None, "IDLE")]


def trace_events(session: str) -> tuple[list[dict], dict[int, str], dict[tuple[int, int], str]]:
  """Complete ("X") events, process names and thread names from the session's Chrome trace."""
  paths = glob.glob(os.path.join(session, "*.trace.json.gz"))
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz in {session}")
  events, procs, threads = [], {}, {}
  for path in paths:
    with gzip.open(path) as f:
      doc = json.load(f)
    for e in doc.get("traceEvents", []):
      if e.get("ph") == "X":
        events.append(e)
      elif e.get("name") == "process_name":
        procs[e["pid"]] = e["args"]["name"]
      elif e.get("name") == "thread_name":
        threads[(e["pid"], e["tid"])] = e["args"]["name"]
  return events, procs, threads


def step_phase(op_name: str) -> str | None:
  """The GRPO update phase of an op from its name-scope path (`jit(train_step)/<scope>/...`), or None."""
  parts = op_name.split("/")
  if OPTIMIZER_SCOPE in parts:
    return "update/optimizer"
  if LOSS_SCOPE in parts:
    # JAX names a VJP's ops `transpose(jvp(...))`; the scan's own bookkeeping counts as forward.
    return "update/loss bwd" if "transpose(" in op_name else "update/loss fwd"
  return None


_INSTRUCTION = re.compile(
  r'^\s*(?:ROOT\s+)?%([^\s=]+)\s*=.*?metadata=\{op_name="((?:[^"\\]|\\.)*)"', re.M
)


def hlo_scopes(session: str, modules: Iterable[str]) -> dict[str, dict[str, str]]:
  """{module: {instruction: name-scope path}} for the named HLO modules (as op events name them, e.g.
  `jit_train_step`), from the HLO the trace carries, printed by xprof's graph_viewer. xprof first
  writes each module as `<module>(<program id>).hlo_proto.pb` into the session (as TensorBoard does)."""
  from xprof.convert import raw_to_tool_data

  paths = sorted(glob.glob(os.path.join(session, "*.xplane.pb")))
  raw_to_tool_data.xspace_to_tool_names(paths)
  wanted, scopes = set(modules), {}
  for path in sorted(glob.glob(os.path.join(session, "*.hlo_proto.pb"))):
    program = os.path.basename(path)[: -len(".hlo_proto.pb")]
    module = re.sub(r"\(\d+\)$", "", program)
    if module not in wanted:
      continue
    text, _ = raw_to_tool_data.xspace_to_tool_data(
      paths,
      "graph_viewer",
      {"graph_viewer_options": {"module_name": program, "type": "long_txt", "show_metadata": 1}},
    )
    text = text.decode() if isinstance(text, bytes) else text
    # Recompiles of one function share its module name; their instruction names mostly agree.
    scopes.setdefault(module, {}).update(m.groups() for m in _INSTRUCTION.finditer(text))
  return scopes


def innermost_segments(events) -> list[tuple[float, float, dict]]:
  """(start, end, event) pieces of each timeline during which `event` is the innermost one running:
  XLA:CPU runs a while loop's body ops inside the loop's own event, so totals would count them twice.
  An event's pieces sum to its self time (its duration minus its children's)."""
  by_stream = collections.defaultdict(list)
  for e in events:
    by_stream[(e["pid"], e["tid"])].append(e)
  out = [seg for stream in by_stream.values() for seg in _stream_pieces(stream)]
  return [seg for seg in out if seg[1] > seg[0]]


def _stream_pieces(stream: list[dict]) -> list[tuple[float, float, dict]]:
  out, stack = [], []  # stack: [event, end, start of its current piece]

  def close_until(t):
    while stack and stack[-1][1] <= t:
      e, end, since = stack.pop()
      out.append((since, end, e))
      if stack:
        stack[-1][2] = end  # the parent runs again from its child's end

  for e in sorted(stream, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
    close_until(e["ts"])
    end = e["ts"] + e.get("dur", 0.0)
    if stack and end <= stack[-1][1]:
      out.append((stack[-1][2], e["ts"], stack[-1][0]))  # the parent's piece up to this child
    elif stack:  # overlapping but not nested (clock skew): close the open events, a sibling
      close_until(float("inf"))
    stack.append([e, end, e["ts"]])
  close_until(float("inf"))
  return out


def self_times(events) -> list[tuple[dict, float]]:
  """(event, its duration minus its children's) for every event, from `innermost_segments`."""
  total = collections.defaultdict(float)
  for start, end, e in innermost_segments(events):
    total[id(e)] += end - start
  return [(e, total[id(e)]) for e in events]


def wall_shares(segments: list[tuple[float, float, dict]]) -> dict[int, float]:
  """{id(event): wall time} where each instant is shared equally among the pieces running then (k
  pieces on k threads: 1/k each). The shares sum to the time some thread was busy (the union of the
  pieces), never more, whereas self times summed over threads count parallel work once per thread."""
  edges = sorted(
    [(s, 1, i) for i, (s, _, _) in enumerate(segments)]
    + [(t, -1, i) for i, (_, t, _) in enumerate(segments)],
    key=lambda x: (x[0], x[1]),  # at one instant, ends before starts
  )
  share = collections.defaultdict(float)
  active: set[int] = set()
  last = None
  for t, kind, i in edges:
    if active and t > last:
      for j in active:
        share[id(segments[j][2])] += (t - last) / len(active)
    last = t
    (active.add if kind > 0 else active.discard)(i)
  return dict(share)


def update_split(scopes: dict[str, dict[str, str]], op_events: list[dict]) -> tuple[dict, dict]:
  """The train step's op time by phase (`step_phase`), plus its unscoped ops (copies, layout changes)
  as `update/other`, over every module that holds a scoped op; and how it was counted.

  XLA:CPU runs independent ops of one step on several threads at once, so the ops' self times summed
  over threads exceed the step's wall time. The split is therefore in wall time (`wall_shares`: an
  instant that k ops share counts 1/k for each) and sums to the time the step's ops kept some thread
  busy; the per-thread sum is returned beside it as `thread_us`."""
  stepping = {m for m, table in scopes.items() if any(map(step_phase, table.values()))}
  mine = [e for e in op_events if e["args"]["hlo_module"] in stepping]
  segments = innermost_segments(mine)
  shares = wall_shares(segments)
  split = collections.defaultdict(float)
  for e in mine:
    phase = step_phase(scopes[e["args"]["hlo_module"]].get(e["args"]["hlo_op"], ""))
    split[phase or "update/other"] += shares.get(id(e), 0.0)
  how = {
    "wall_us": sum(split.values()),
    "thread_us": sum(end - start for start, end, _ in segments),
    "threads": len({(e["pid"], e["tid"]) for e in mine}),
  }
  return dict(sorted(split.items())), how


def _device_events(events, procs):
  """Events on accelerator timelines; on CPU (no device timeline) XLA's own execution threads."""
  device = [e for e in events if procs.get(e["pid"], "").startswith("/device:")]
  return device, "device" if device else "host (XLA:CPU executes on the host)"


def summarize(run_dir: str, top: int = 15, gap_us: float = 100.0) -> dict:
  session = latest_session(run_dir)
  events, procs, _ = trace_events(session)
  device, where = _device_events(events, procs)
  # Executed XLA ops name their module and instruction (device kernels on GPU, thunks on XLA:CPU):
  # ranked by self time and labelled with their name scope. Without them, every non-annotation event.
  op_events = [
    e for e in (device or events) if {"hlo_op", "hlo_module"} <= e.get("args", {}).keys()
  ]
  scopes, split, split_how = {}, {}, {}
  if op_events:
    timed = self_times(op_events)
    try:
      scopes = hlo_scopes(session, {e["args"]["hlo_module"] for e in op_events})
    except Exception as err:  # xprof missing, or HLO it cannot print: the rest still stands
      split = {"error": f"{type(err).__name__}: {err}"}
    else:
      split, split_how = update_split(scopes, op_events)
  else:
    timed = [
      (e, e.get("dur", 0.0))
      for e in device or events
      if not e["name"].startswith(("$", PHASE_PREFIX, BENCH_PREFIX))
    ]
  kernels, counts, scope_of = collections.Counter(), collections.Counter(), {}
  for e, us in timed:
    kernels[e["name"]] += us
    counts[e["name"]] += 1
    args = e.get("args", {})
    scope_of.setdefault(e["name"], scopes.get(args.get("hlo_module"), {}).get(args.get("hlo_op")))
  phases = collections.defaultdict(float)
  for e in events:
    if e["name"].startswith(PHASE_PREFIX):
      phases[e["name"][len(PHASE_PREFIX) :]] += e.get("dur", 0.0)
    elif e["name"].startswith(BENCH_PREFIX):
      phases[e["name"]] += e.get("dur", 0.0)
  gaps = _gaps(device, gap_us) if device else None
  try:
    ops = op_stats(session)
  except Exception as err:  # xprof missing or a format it does not know: the rest still stands
    ops = [{"error": f"{type(err).__name__}: {err}"}]
  return {
    "session": session,
    "timeline": where,
    "truncated": len(events) >= TRACE_EVENT_CAP,
    "ops_total_us": sum(kernels.values()),  # every op's self time: the share's denominator
    "top": [
      {
        "name": n,
        "total_us": t,
        "count": counts[n],
        "scope": scope_of[n],
        "share": t / max(sum(kernels.values()), 1e-9),
      }
      for n, t in kernels.most_common(top)
    ],
    "phases_us": dict(sorted(phases.items())),
    "update_split_us": split,
    "update_split_counting": split_how,
    "gaps": gaps,
    "op_stats": sorted(ops, key=lambda r: -(r.get("total_self_time") or 0))[:top],
  }


def _gaps(device_events, gap_us):
  """Idle stretches between consecutive ops on each device stream longer than `gap_us` (host gaps)."""
  by_stream = collections.defaultdict(list)
  for e in device_events:
    by_stream[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
  total, count, longest = 0.0, 0, 0.0
  for spans in by_stream.values():
    spans.sort()
    end = spans[0][1]
    for start, stop in spans[1:]:
      if start - end > gap_us:
        total += start - end
        count += 1
        longest = max(longest, start - end)
      end = max(end, stop)
  return {"threshold_us": gap_us, "count": count, "total_us": total, "longest_us": longest}


def _tail(text: str, n: int) -> str:
  return text if len(text) <= n else "..." + text[-(n - 3) :]


def format_summary(s: dict) -> str:
  lines = [f"profile: {s['session']}"]
  if s.get("truncated"):
    lines.append(
      f"WARNING: the trace's event export stopped at {TRACE_EVENT_CAP:,} events, so what follows "
      "covers only the start of the run; capture less (fewer bench suites / sizes, fewer steps) "
      "or open the .xplane.pb in TensorBoard, which has everything"
    )
  total = s.get("ops_total_us")
  lines.append(
    f"top ops by total self time ({s['timeline']}"
    + (f"; all ops {total / 1e3:.3f} ms" if total else "")
    + "):"
  )
  lines += [
    f"  {r['total_us'] / 1e3:10.3f} ms {100 * r.get('share', 0):5.1f}%  x{r['count']:<6d} "
    f"{r['name'][:60]}" + (f"  [{_tail(r['scope'], 90)}]" if r.get("scope") else "")
    for r in s["top"]
  ]
  if s["phases_us"]:
    lines.append("phases (host annotations: GRPO step phases, bench cases):")
    lines += [f"  {us / 1e3:10.3f} ms  {name}" for name, us in s["phases_us"].items()]
  split = s.get("update_split_us") or {}
  if "error" in split:
    lines.append(f"update split: unavailable ({split['error']})")
  elif split:
    how = s.get("update_split_counting") or {}
    lines.append(f"GRPO update by name scope (wall time of its ops, {s['timeline']}):")
    lines += [f"  {us / 1e3:10.3f} ms  {name}" for name, us in split.items()]
    if how.get("threads", 1) > 1:
      lines += [
        f"  (its ops ran on {how['threads']} threads, often several at once: an instant shared by k "
        "ops counts 1/k to each,",
        f"  so the split sums to the {how['wall_us'] / 1e3:.3f} ms some thread was busy with them, "
        f"{how['thread_us'] / 1e3:.3f} ms summed per thread;",
        "  the `update` phase also holds dispatch and host work between them)",
      ]
  if s["gaps"] is not None:
    g = s["gaps"]
    lines.append(
      f"device idle gaps > {g['threshold_us']:.0f} us: {g['count']} totalling {g['total_us'] / 1e3:.3f} ms "
      f"(longest {g['longest_us'] / 1e3:.3f} ms)"
    )
  else:
    lines.append("device idle gaps: no device timeline in this trace (CPU run)")
  if s["op_stats"] and "error" not in s["op_stats"][0]:
    lines.append("xprof framework_op_stats (by self time):")
    lines += [
      f"  {r.get('total_self_time', 0) / 1e3:10.3f} ms  {r.get('host_or_device')}  {r.get('operation')}"
      for r in s["op_stats"]
    ]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(
    prog="python -m bench.trace", description="Summarise a captured profile."
  )
  ap.add_argument("run_dir", help="profiles/<run> (a jax.profiler.trace log directory)")
  ap.add_argument("--top", type=int, default=15)
  ap.add_argument("--gap-us", type=float, default=100.0)
  ap.add_argument("--json", action="store_true", help="print the summary as JSON")
  args = ap.parse_args(argv)
  s = summarize(args.run_dir, args.top, args.gap_us)
  print(json.dumps(s, indent=1) if args.json else format_summary(s))
  return s


if __name__ == "__main__":
  main()
