"""Bench reports: results.json (environment, every case, the rollout suite), summary.md, and plots.

``python -m bench.report bench/results/<run>`` re-renders a report's summary.md and figures from its
results.json, measuring nothing (for a committed report after a change to the figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform as _platform
import tempfile

import jax

from bench import mismatch
from bench.kernels.roofline import DevicePeaks
from bench.kernels.run import CaseResult
from bench.provenance import git_commit
from bench.rollout import table as rollout_table


def environment(peaks: DevicePeaks, target_platform: str, interpret: bool) -> dict:
  dev = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "device_kind": dev.device_kind,
    "device_platform": dev.platform,
    "device_count": jax.device_count(),
    "kernel_target": target_platform,
    "interpret_mode": interpret,
    "jax": jax.__version__,
    "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
    "python": _platform.python_version(),
    "host": _platform.machine(),
    "git_commit": git_commit(),
    "peaks": dataclasses.asdict(peaks),
  }


def _fmt_time(s):
  return "-" if s is None else (f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s")


def _fmt_pct(x):
  return "-" if x is None else f"{100 * x:.1f}%"


def _fmt_bytes(b):
  return "-" if b is None else f"{b / 2**20:.1f} MiB"


def as_dict(result) -> dict:
  """A case result in results.json's form (a CaseResult, or already a dict)."""
  return dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result


def markdown_table(results) -> str:
  """One row per case (CaseResults or their results.json dicts): kernel vs reference side by side."""
  head = (
    "| case | kernel median (IQR) | reference median | speedup | kernel roofline | reference roofline "
    "| TFLOP/s kernel / ref | kernel temp mem | reference temp mem | parity (err/tol) | ok |"
  )
  rows = [head, "|" + "---|" * 11]
  for r in map(as_dict, results):
    if r.get("skipped"):
      rows.append(f"| {r['name']} | skipped: {r['skipped']} |" + " - |" * 9)
      continue
    if r["kernel"] is None:
      rows.append(f"| {r['name']} | failed: {r['error']} |" + " - |" * 8 + " no |")
      continue
    k, ref = r["kernel"], r["reference"]
    parity = ", ".join(f"{label} {err:.2g}" for label, err in r["parity"].items())
    rows.append(
      f"| {r['name']} | {_fmt_time(k['timing']['median_s'])} ({_fmt_time(k['timing']['iqr_s'])}) "
      f"| {_fmt_time(ref['timing']['median_s'])} | {r['speedup']:.2f}x "
      f"| {_fmt_pct(k['roofline_fraction'])} | {_fmt_pct(ref['roofline_fraction'])} "
      f"| {_fmt_flops(k)} / {_fmt_flops(ref)} | {_fmt_bytes(k['memory']['temp_bytes'])} "
      f"| {_fmt_bytes(ref['memory']['temp_bytes'])} | {parity} | {'yes' if r['ok'] else 'NO'} |"
    )
  return "\n".join(rows)


SIZE_MEANING = {
  "tiny": "the harness's own smoke test (seconds; what the test suite runs)",
  "small": "CPU shapes: big enough to exercise tiling and ragged tails in the Pallas interpreter",
  "large": "production shapes: 8k-16k completion tokens over V = 128256-151936, decode over 4k-16k "
  "contexts, the Qwen2.5-0.5B / 1.5B parameter trees",
}


def describe_shape(params: dict) -> str:
  """A case's shape in words, from the `params` its bench case records."""
  p = params
  if {"q_heads", "kv_heads", "ctx"} <= p.keys():
    return (
      f"{p['batch']} sequences decoding over up to {p['ctx']} cached tokens (3/4 ctx to ctx), "
      f"{p['q_heads']} query / {p['kv_heads']} KV heads of {p['head_dim']}, pages of "
      f"{p['page_size']}, {p['dtype']}"
    )
  if {"tokens", "vocab"} <= p.keys():
    hidden = f", hidden H = {p['hidden']}" if "hidden" in p else ""
    return (
      f"N = {p['batch']} x {p['seq']} = {p['tokens']} tokens, vocabulary V = {p['vocab']}{hidden}, "
      f"{p['dtype']}"
    )
  if {"model", "params"} <= p.keys():
    return f"the `{p['model']}` model's parameter tree: {p['params']:,} {p['dtype']} parameters in {p['leaves']} arrays"
  return ", ".join(f"{k} {v}" for k, v in p.items() if k != "impl")


def sizes_section(env: dict, cases: list[dict]) -> str:
  sizes = env.get("sizes") or []
  lines = ["## Sizes", ""]
  lines += [f"`--size {s}`: {SIZE_MEANING.get(s, s)}." for s in sizes]
  lines += ["", "| op | shape | what it is |", "|---|---|---|"]
  seen = {}
  for c in cases:
    family = c["op"].split("/")[0]
    seen.setdefault((family, c["shape"]), describe_shape(c["params"]))
  lines += [f"| {family} | {shape} | {text} |" for (family, shape), text in seen.items()]
  return "\n".join(lines)


def write_atomic(path: pathlib.Path, text: str) -> None:
  """Write ``text`` to ``path`` through a temporary file and a rename: a process killed at any moment
  leaves either the previous file or the new one, never half of one."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


def write(
  out_dir: pathlib.Path,
  env: dict,
  results: list[CaseResult],
  rollout_runs: list[dict] = (),
  plots: bool = True,
  mismatch_runs: list[dict] = (),
  remaining: list[str] | None = None,
) -> pathlib.Path:
  """results.json, then summary.md and (with `plots`) the figures rendered from it (`render`).

  ``remaining``: the cases / suites still to run. Given (even empty), the report is marked partial
  with them: ``python -m bench`` rewrites its report so after every case and every rollout row, and
  only the final write (``remaining=None``) is complete.
  """
  out_dir.mkdir(parents=True, exist_ok=True)
  rollout_json = [dict(run, rows=[as_dict(r) for r in run["rows"]]) for run in rollout_runs]
  payload = {"environment": env, "cases": [as_dict(r) for r in results], "rollout": rollout_json}
  if mismatch_runs:
    payload["mismatch"] = [
      dict(run, rows=[as_dict(r) for r in run["rows"]]) for run in mismatch_runs
    ]
  if remaining is not None:
    payload["partial"] = {"remaining": list(remaining)}
  write_atomic(out_dir / "results.json", json.dumps(payload, indent=2, default=float) + "\n")
  return render(out_dir, plots=plots)


def partial_note(payload: dict) -> str:
  """The banner of a report whose run stopped (or is still running) before its end."""
  partial = payload.get("partial")
  if partial is None:
    return ""
  left = partial.get("remaining", [])
  done = len(payload.get("cases", []))
  shown = ", ".join(left[:20]) + (f", ... ({len(left) - 20} more)" if len(left) > 20 else "")
  return (
    f"> **PARTIAL report**: the run stopped (or is still running) after {done} case(s); "
    f"{len(left)} still to run{': ' + shown if left else ''}.\n\n"
  )


def render(out_dir: pathlib.Path, plots: bool = True) -> pathlib.Path:
  """summary.md and the figures from `out_dir`/results.json (nothing is measured)."""
  payload = json.loads((out_dir / "results.json").read_text())
  if payload["environment"].get("measurement") == "compiled":
    return _render_compiled(out_dir, payload, plots)
  env, cases, rollout_runs = payload["environment"], payload["cases"], payload.get("rollout", [])
  note = (
    "\n\n> Kernel timings here come from the Pallas **interpreter** on CPU: they check the harness "
    "and parity, and are not kernel performance.\n"
    if env["interpret_mode"]
    else "\n"
  )
  header = (
    f"# Bench: {env['device_kind']} ({env['device_platform']}), jax {env['jax']}, {env['date']}, "
    f"commit {env['git_commit']}\n\n{partial_note(payload)}{peaks_line(env['peaks'])}{note}\n"
  )
  body = (
    markdown_table(cases) + "\n\n" + sizes_section(env, cases)
    if cases
    else "(no kernel cases selected)"
  )
  if any(c.get("compiled") for c in cases):  # a TPU run with --target: modelled beside measured
    body += "\n\n## Compiled and modelled beside measured\n\n" + compiled_table(cases)
  for run in rollout_runs:
    rows = [rollout_table.RolloutBenchRow(**r) for r in run["rows"]]
    body += f"\n\n## Rollout engines ({run['size']}: {_rollout_shape(run['config'])})\n\n"
    body += rollout_table.markdown(rows, run)
  if env.get("loop"):
    from bench.loop import step_time as loop  # lazily: it runs the GRPO loop (rl.train)

    body += "\n\n## GRPO loop step time (regression benchmark, `bench/history/loop.jsonl`)\n\n"
    body += loop.describe(env["loop"]["row"], env["loop"]["comparison"]) + "\n"
  for run in payload.get("mismatch", []):
    rows = [mismatch.MismatchRow(**r) for r in run["rows"]]
    body += (
      f"\n\n## Engine log-probs vs the trainer ({run['size']}: {_rollout_shape(run['config'])})"
    )
    body += f"\n\n{mismatch.NOTE}\n\n" + mismatch.markdown(rows)
  figures = _plots(out_dir, env, cases, rollout_runs) if plots else []
  body += "".join(f"\n\n![{f.stem}]({f.name})" for f in figures)
  write_atomic(out_dir / "summary.md", header + body + "\n")
  return out_dir


def _ms(s) -> str:
  return "-" if s is None else f"{s * 1e3:.3f} ms"


def _xla_ms(s) -> str:
  """XLA's optimal time as XLA gave it; one that is not a time (negative) is marked unused."""
  if s is None or (s >= 0 and s == s):
    return _ms(s)
  return f"{_ms(s)} (XLA's cost model; not a time, unused)"


def _compiled_kernel_cells(k: dict) -> tuple[str, str, str]:
  """(VMEM, bundles per step x steps, spills per step) over a side's Mosaic kernels."""
  ks = k.get("kernels") or []
  if not ks:
    return "-", "no Mosaic kernel (XLA only)", "-"
  vmem = ", ".join(_fmt_bytes(x["vmem_bytes"]) for x in ks)
  sched = ", ".join(
    f"{x['name']}: {x['step_bundles']} x {x['grid']}" if x["step_bundles"] is not None
    else f"{x['name']}: not readable ({'; '.join(x['problems'])})"
    for x in ks
  )  # fmt: skip
  spills = ", ".join(f"{x['step_spill_loads']} / {x['step_spill_stores']}" for x in ks)
  return vmem, sched, spills


def compiled_table(results) -> str:
  """One row per case of a compiled report (or of a TPU run with its modelled figures beside)."""
  head = (
    "| case | kernel compiles | kernel VMEM (compiled) | bundles per grid step x grid (compiled) "
    "| spill loads / stores per step (compiled) | HBM peak kernel / reference (compiled) "
    "| kernel compute (modelled) | byte / flop floor (modelled) | kernel time (modelled) "
    "| reference: XLA bytes accessed / ideal (compiled) | reference: XLA optimal time (compiled) "
    "| measured kernel |"
  )
  rows = [head, "|" + "---|" * 12]
  for r in map(as_dict, results):
    c = r.get("compiled")
    if not c:
      why = f"skipped: {r['skipped']}" if r.get("skipped") else f"failed: {r.get('error')}"
      rows.append(f"| {r['name']} | {why} |" + " - |" * 10)
      continue
    k, ref, m = c["kernel"], c["reference"], c["model"]
    status = "yes" if k["status"] == "ok" else f"no: {k['error']}"
    vmem, sched, spills = _compiled_kernel_cells(k) if k["status"] == "ok" else ("-",) * 3
    peak = lambda side: _fmt_bytes(_peak(side.get("memory")))
    cost = ref.get("cost", {})
    ratio = (
      f"{cost['bytes_accessed'] / 1e9:.2f} GB / {r['bytes'] / 1e9:.2f} GB "
      f"({cost['bytes_accessed'] / r['bytes']:.1f}x)"
      if cost.get("bytes_accessed") and r.get("bytes") else "-"
    )  # fmt: skip
    t = _ms(m["modelled_s"]) + (f" ({m['bound']})" if m["bound"] else f" ({m['why']})")
    t += "".join(f"; {note}" for note in m.get("notes", []))
    floors = f"{_ms(m['memory_s'])} / {_ms(m.get('flop_s'))}"
    measured = _fmt_time(r["kernel"]["timing"]["median_s"]) if r.get("kernel") else "-"
    rows.append(
      f"| {r['name']} | {status} | {vmem} | {sched} | {spills} | {peak(k)} / {peak(ref)} "
      f"| {_ms(m['compute_s'])} | {floors} | {t} | {ratio} "
      f"| {_xla_ms(cost.get('optimal_s'))} | {measured} |"
    )
  return "\n".join(rows)


def _peak(mem: dict | None):
  if not mem or any(mem.get(k) is None for k in ("temp_bytes", "argument_bytes", "output_bytes")):
    return None
  return (
    mem["temp_bytes"] + mem["argument_bytes"] + mem["output_bytes"] - (mem.get("alias_bytes") or 0)
  )


def _render_compiled(out_dir: pathlib.Path, payload: dict, plots: bool) -> pathlib.Path:
  env, cases = payload["environment"], payload["cases"]
  gen = env["target"]
  header = (
    f"# Compiled report: {env['device_kind']} ({gen}), jax {env['jax']}, libtpu {env['libtpu']}, "
    f"{env['date']}, commit {env['git_commit']}\n\n{partial_note(payload)}"
    f"> **{env['label']}.** Compiled: what libtpu's compiler reports (compile status, memory "
    "analysis, XLA's cost model, the Mosaic kernels' static schedules). Modelled: time derived from "
    "them, max(each kernel's bundles / clock x its runs + XLA's optimal time for the other ops "
    "(loop bodies' matmuls counted per trip), ideal bytes / HBM bandwidth, flops / bf16 peak) at "
    f"{env['clock_hz'] / 1e9:.2f} GHz and {_bw(env['peaks'])} (datasheet; kernels.tpu_targets); "
    "a stall-free schedule, so a floor, not a prediction; a negative XLA figure is not used.\n\n"
  )
  body = compiled_table(cases) + "\n\n" + sizes_section(env, cases) if cases else "(no cases)"
  figures = []
  if plots and any((c.get("compiled") or {}).get("model", {}).get("modelled_s") for c in cases):
    from bench import plots as plots_mod

    figures.append(plots_mod.modelled_chart(cases, env, out_dir / "modelled.png"))
  body += "".join(f"\n\n![{f.stem}]({f.name})" for f in figures)
  write_atomic(out_dir / "summary.md", header + body + "\n")
  return out_dir


def _rollout_shape(c: dict) -> str:
  return (
    f"model {c['model']}, {c['prompts']} prompts x {c['n']} samples, prompt {c['prompt_len']} + "
    f"{c['new_tokens']} new tokens, page {c['page_size']}"
  )


def _plots(out_dir, env, cases, rollout_runs) -> list[pathlib.Path]:
  from bench import plots  # matplotlib: imported only when figures are wanted

  figures = []
  if plots.timed(cases):
    figures.append(plots.roofline_chart(cases, env["peaks"], out_dir / "roofline.png"))
    figures.append(plots.time_vs_size(cases, out_dir / "time_vs_size.png"))
  if rollout_runs:
    rows = [
      dict(r, workload=f"{run['size']}/{r['workload']}")
      for run in rollout_runs
      for r in run["rows"]
    ]
    figures.append(plots.rollout_chart(rows, out_dir / "rollout.png"))
  return figures


def _fmt_flops(impl: dict) -> str:
  fps = impl.get("achieved_flops_per_s")
  return "-" if fps is None else f"{fps / 1e12:.3g}"


def _bw(peaks: dict) -> str:
  bw = peaks.get("hbm_bytes_per_s")
  return "unknown" if bw is None else f"{bw / 1e9:.1f} GB/s"


def peaks_line(peaks: dict) -> str:
  """The roofline's ceilings: measured (best / median) beside the datasheet, when the run has both
  (reports from before the measured ceilings carry one bandwidth and its source)."""
  if "datasheet_hbm_bytes_per_s" not in peaks:
    return f"Bandwidth used for roofline: {_bw(peaks)} ({peaks['source']})."
  g = lambda x, unit, d: "-" if x is None else f"{x / d:.3g} {unit}"
  hbm = lambda k: g(peaks.get(k), "TB/s", 1e12)
  mm = lambda k: g(peaks.get(k), "TFLOP/s", 1e12)
  return (
    "| ceiling | measured best | measured median | datasheet |\n|---|---|---|---|\n"
    f"| HBM bandwidth | {hbm('hbm_bytes_per_s')} | {hbm('hbm_median_bytes_per_s')} "
    f"| {hbm('datasheet_hbm_bytes_per_s')} |\n"
    f"| bf16 matmul | {mm('bf16_flops_per_s')} | {mm('bf16_median_flops_per_s')} "
    f"| {mm('datasheet_bf16_flops_per_s')} |\n\n"
    f"Roofline fractions are against the {peaks['source']} ceilings."
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m bench.report",
    description="Re-render a report's summary.md and figures from its results.json.",
  )
  p.add_argument("run_dir", type=pathlib.Path, help="a report directory holding results.json")
  p.add_argument("--no-plots", action="store_true")
  a = p.parse_args(argv)
  if not (a.run_dir / "results.json").is_file():
    p.error(f"run_dir: no results.json in {a.run_dir}")
  render(a.run_dir, plots=not a.no_plots)
  print(f"re-rendered {a.run_dir}/summary.md{'' if a.no_plots else ' and figures'}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
