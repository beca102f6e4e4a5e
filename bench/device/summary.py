"""What each step of a ``bench.device`` call kept, in words: the rows of the call's summary.md.

Read from the step's own files in the call's work directory (results.json, the tuning cache,
parity.md, the trace summary in its log), so a step stopped by its limit is described by what it
wrote before it was stopped.
"""

from __future__ import annotations

import json
import pathlib
import re

# absl / XLA log lines that xprof's converters print on stderr (merged into the step's log)
_LOG_NOISE = re.compile(r"^([EWIF]\d{4} |WARNING: All log messages before absl)")
MAX_DETAIL_LINES = 40  # the summary is printed last: it must fit a device command's output tail


def describe(result, work: pathlib.Path) -> tuple[str, str]:
  """(what the step kept, a detail block for the summary) for one ``StepResult``."""
  if result.skipped:
    return "-", ""
  log = work / result.log
  text = log.read_text(errors="replace") if log.exists() else ""
  if result.name == "env":
    env = _json(work / "env.json")
    return ("env.json", f"{env.get('devices')} jax {env.get('jax')}") if env else ("-", "")
  if result.name == "gpu-tests":
    tail = [
      ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or " skipped" in ln
    ]
    return (tail[-1].strip("= ") if tail else "-"), ""
  if result.name == "trace":
    body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
    body = "\n".join(ln for ln in body.splitlines() if not _LOG_NOISE.match(ln))
    if "top ops" not in body:  # no summary: the error's last lines say why
      return "-", "\n".join(body.strip().splitlines()[-3:])
    return "trace summary", _clip(body)
  if result.name == "parity":
    md = work / "parity" / "parity.md"
    return ("parity.md", _clip(md.read_text())) if md.exists() else ("-", "")
  if result.name == "profile":
    return ("trace" if (work / "profile").exists() else "-"), ""
  if result.results == "tuning":
    return _tune(work / "tuning", result.name)
  if result.results and (work / result.results / "results.json").exists():
    return _bench(work / result.results / "results.json")
  return "-", ""


def _json(path: pathlib.Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _clip(text: str) -> str:
  lines = text.strip().splitlines()
  if len(lines) > MAX_DETAIL_LINES:
    lines = lines[:MAX_DETAIL_LINES] + [f"... ({len(lines) - MAX_DETAIL_LINES} more lines)"]
  return "\n".join(lines)


def _ms(impl: dict | None) -> str:
  return "-" if not impl else f"{impl['timing']['median_s'] * 1e3:.3f}"


def _bench(path: pathlib.Path) -> tuple[str, str]:
  payload = _json(path) or {}
  cases, rollout = payload.get("cases", []), payload.get("rollout", [])
  left = (payload.get("partial") or {}).get("remaining")
  kept = f"{len(cases)} cases" if cases or not rollout else ""
  kept += (
    f"{' + ' if kept else ''}{sum(len(r['rows']) for r in rollout)} rollout rows" if rollout else ""
  )
  if left is not None:
    kept += f" (PARTIAL: {len(left)} not run)"
  lines = []
  if cases:
    lines += [
      "| case | kernel ms | reference ms | speedup | worst parity | ok |",
      "|---|---|---|---|---|---|",
    ]
  for c in cases:
    if c.get("skipped") or c.get("kernel") is None:
      why = c.get("skipped") or c.get("error") or "?"
      lines.append(
        f"| {c['name']} | {'skipped' if c.get('skipped') else 'failed'}: {why[:120]} | | | | |"
      )
      continue
    worst = max(c["parity"].values(), default=0.0)
    lines.append(
      f"| {c['name']} | {_ms(c['kernel'])} | {_ms(c['reference'])} | {c['speedup']:.2f}x | "
      f"{worst:.2g} | {'yes' if c['ok'] else 'NO'} |"
    )
  for run in rollout:
    lines += ["", "| rollout | backend | tokens/s | decode s | ok |", "|---|---|---|---|---|"]
    lines += [
      f"| {run['size']}/{r['workload']} | {r['backend']} | {r['tokens_per_s']:.1f} | "
      f"{r['decode_s']:.3f} | {'yes' if r['ok'] else 'NO'} |"
      for r in run["rows"]
    ]
  if left:
    lines.append(f"\nnot run: {', '.join(left)}")
  peaks = (payload.get("environment") or {}).get("peaks") or {}
  if peaks.get("hbm_bytes_per_s"):
    from bench.report import peaks_line

    lines = [peaks_line(peaks), "", *lines]
  return kept or "-", "\n".join(lines)


def _tune(directory: pathlib.Path, op: str) -> tuple[str, str]:
  files = sorted(directory.glob("*.json"))
  data = _json(files[0]) if files else None
  entries = ((data or {}).get("entries") or {}).get(op) or {}
  if not entries:
    return "-", ""
  lines = [
    "| bucket | heuristic ms | winner | winner ms | tried / not tried |",
    "|---|---|---|---|---|",
  ]
  for key, e in entries.items():
    base = e.get("heuristic") or {}
    rows = e["candidates"]
    win = e.get("winner")
    best = next(
      (r for r in rows if win and r["impl"] == win["impl"] and r["blocks"] == win["blocks"]), None
    )
    ms = lambda r: "-" if not r or r.get("time_s") is None else f"{r['time_s'] * 1e3:.3f}"
    tried = sum(1 for r in rows if not r.get("skipped"))
    label = best["label"] if best else ("none passed" if tried else "none tried (budget spent)")
    lines.append(f"| {key} | {ms(base)} | {label} | {ms(best)} | {tried} / {len(rows) - tried} |")
  return f"{len(entries)} buckets", "\n".join(lines)
