"""Profiler traces: capture (`capture`) and inspection (`python -m bench.trace profiles/<run>`).

Capture writes what `jax.profiler.trace` writes — an XSpace (`*.xplane.pb`, for TensorBoard's profile
plugin / xprof), its Chrome-trace JSON (`*.trace.json.gz`) and a Perfetto trace — under
`profiles/<run>/plugins/profile/<time>/`. Inspection reads them with xprof's own converters (op table:
`framework_op_stats`) and the trace events jax wrote (phases, kernels, gaps); no protobuf parsing here.

Phases are `jax.profiler.TraceAnnotation`s named `grpo/...` (the loop's `rl.metrics.StepTimer` and the
rollout engines emit `grpo/rollout`, `grpo/rollout/prefill`, `grpo/rollout/decode`, `grpo/update`, ...)
or `bench/<case>/<kernel|reference>` (the timed repeats of `python -m bench --profile`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
from collections.abc import Sequence

import jax

from rl.metrics import profiler_options

PHASE_PREFIX = "grpo/"  # the loop's phases, reported without the prefix
BENCH_PREFIX = "bench/"  # bench cases' timed repeats, reported by full name
# The Chrome-trace export keeps the first million events (the XSpace keeps all): a summary that reached
# this count saw only the start of the run.
TRACE_EVENT_CAP = 1_000_000


@contextlib.contextmanager
def capture(run_dir: str, python_frames: bool = False):
  """Profile the enclosed work into `run_dir` (open with `tensorboard --logdir run_dir`)."""
  os.makedirs(run_dir, exist_ok=True)
  with jax.profiler.trace(run_dir, create_perfetto_trace=True, profiler_options=profiler_options(python_frames)):
    yield run_dir


def latest_session(run_dir: str) -> str:
  """The newest `plugins/profile/<time>` directory under `run_dir` (or `run_dir` itself if it is one)."""
  if glob.glob(os.path.join(run_dir, "*.xplane.pb")):
    return run_dir
  sessions = sorted(glob.glob(os.path.join(run_dir, "plugins", "profile", "*")))
  if not sessions:
    raise FileNotFoundError(f"no profile under {run_dir} (expected plugins/profile/<time>/*.xplane.pb)")
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


def _device_events(events, procs):
  """Events on accelerator timelines; on CPU (no device timeline) XLA's own execution threads."""
  device = [e for e in events if procs.get(e["pid"], "").startswith("/device:")]
  return device, "device" if device else "host (XLA:CPU executes on the host)"


def summarize(run_dir: str, top: int = 15, gap_us: float = 100.0) -> dict:
  session = latest_session(run_dir)
  events, procs, _ = trace_events(session)
  device, where = _device_events(events, procs)
  kernels = collections.Counter()
  counts = collections.Counter()
  source = device or [e for e in events if not e["name"].startswith(("$", PHASE_PREFIX, BENCH_PREFIX))]
  for e in source:
    kernels[e["name"]] += e.get("dur", 0.0)
    counts[e["name"]] += 1
  phases = collections.defaultdict(float)
  for e in events:
    if e["name"].startswith(PHASE_PREFIX):
      phases[e["name"][len(PHASE_PREFIX):]] += e.get("dur", 0.0)
    elif e["name"].startswith(BENCH_PREFIX):
      phases[e["name"]] += e.get("dur", 0.0)
  gaps = _gaps(device, gap_us) if device else None
  try:
    ops = op_stats(session)
  except Exception as err:  # xprof missing or a format it does not know: the rest still stands
    ops = [{"error": f"{type(err).__name__}: {err}"}]
  return {"session": session, "timeline": where, "truncated": len(events) >= TRACE_EVENT_CAP,
          "top": [{"name": n, "total_us": t, "count": counts[n]} for n, t in kernels.most_common(top)],
          "phases_us": dict(sorted(phases.items())), "gaps": gaps,
          "op_stats": sorted(ops, key=lambda r: -(r.get("total_self_time") or 0))[:top]}


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


def format_summary(s: dict) -> str:
  lines = [f"profile: {s['session']}"]
  if s.get("truncated"):
    lines.append(f"WARNING: the trace's event export stopped at {TRACE_EVENT_CAP:,} events, so what follows "
                 "covers only the start of the run; capture less (fewer bench suites / sizes, fewer steps) "
                 "or open the .xplane.pb in TensorBoard, which has everything")
  lines.append(f"top ops by total time ({s['timeline']}):")
  lines += [f"  {r['total_us'] / 1e3:10.3f} ms  x{r['count']:<6d} {r['name'][:90]}" for r in s["top"]]
  if s["phases_us"]:
    lines.append("phases (host annotations: GRPO step phases, bench cases):")
    lines += [f"  {us / 1e3:10.3f} ms  {name}" for name, us in s["phases_us"].items()]
  if s["gaps"] is not None:
    g = s["gaps"]
    lines.append(f"device idle gaps > {g['threshold_us']:.0f} us: {g['count']} totalling {g['total_us'] / 1e3:.3f} ms "
                 f"(longest {g['longest_us'] / 1e3:.3f} ms)")
  else:
    lines.append("device idle gaps: no device timeline in this trace (CPU run)")
  if s["op_stats"] and "error" not in s["op_stats"][0]:
    lines.append("xprof framework_op_stats (by self time):")
    lines += [f"  {r.get('total_self_time', 0) / 1e3:10.3f} ms  {r.get('host_or_device')}  {r.get('operation')}"
              for r in s["op_stats"]]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m bench.trace", description="Summarise a captured profile.")
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
