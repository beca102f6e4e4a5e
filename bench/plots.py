"""Report figures (matplotlib, written next to results.json), each answering one question.

* roofline.png — how close does each kernel come to the device's limits, and is it above or below its
  reference? Ops with a flop count: one panel per op, a case's kernel (filled) and reference (hollow)
  at the same arithmetic intensity joined by a line, its mode by marker (fwd o, fwd+bwd ^) and its
  shape by one label per shape, under the bandwidth / compute roofs when the device's peaks are known. Ops with no flop count (bandwidth-bound): achieved bytes/s per case, one
  row each, against the bandwidth line.
* time_vs_size.png — is the kernel faster than its reference at each size? Per op family, every case
  (sorted by ideal bytes within each variant) with kernel and reference median time (quartile whiskers) and the
  speedup (reference / kernel) written above. Cases are categories, not points on a size axis: two
  named sizes differ in dtype and shape, so no line joins them.
* rollout.png — generated tokens/s per engine and workload.

Every function takes the report's JSON form (`results.json`'s `cases` / rollout rows), so a committed
report re-renders without re-measuring: ``python -m bench.report bench/results/<run>``.
"""

from __future__ import annotations

import collections
import math
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

KERNEL = dict(marker="o", color="tab:blue", markersize=7, linestyle="none")
REFERENCE = dict(
  marker="o", markerfacecolor="white", markeredgecolor="tab:orange", markeredgewidth=1.6,
  color="tab:orange", markersize=7, linestyle="none",
)  # fmt: skip
MODE_MARKER = {"fwd": "o", "fwd+bwd": "^"}  # roofline: a case's mode by marker, its shape by label
SIDES = (("kernel", KERNEL, "kernel (Pallas)"), ("reference", REFERENCE, "reference (pure JAX)"))
DPI = 120


def timed(cases: list[dict]) -> list[dict]:
  """Cases that produced timings (a failed case has no kernel / reference entry)."""
  return [c for c in cases if c.get("kernel") and c.get("reference")]


def _median(case: dict, side: str) -> float:
  return case[side]["timing"]["median_s"]


def _case_label(case: dict, family: str | None = None) -> str:
  """`<variant> <shape> <mode>` without the parts the panel title already says."""
  parts = case["op"].split("/")[1:] if family else []
  return " ".join([*parts, case["shape"], case["mode"]])


def _legend_handles(extra=()):
  return [Line2D([], [], **style, label=label) for _, style, label in SIDES] + list(extra)


def _declutter(ax, texts, pad_px: float = 2.0):
  """Shift overlapping annotations up, in drawing order by height, until none overlap."""
  if not texts:
    return
  renderer = ax.figure.canvas.get_renderer()
  placed = []
  for t in sorted(texts, key=lambda t: t.get_window_extent(renderer).y0):
    box = t.get_window_extent(renderer)
    shift = 0.0
    for other in placed:
      moved = box.translated(0, shift)
      if moved.overlaps(other):
        shift += other.y1 - moved.y0 + pad_px
    if shift:
      dx, dy = t.xyann
      t.xyann = (dx, dy + shift * 72.0 / ax.figure.dpi)
    placed.append(box.translated(0, shift))


def roofline_chart(cases: list[dict], peaks: dict, path: pathlib.Path) -> pathlib.Path:
  bw, fl = peaks.get("hbm_bytes_per_s"), peaks.get("bf16_flops_per_s")
  with_flops = [c for c in timed(cases) if c["flops"] and c["bytes"]]
  bytes_only = [c for c in timed(cases) if c["bytes"] and not c["flops"]]
  n_top = max(len({c["op"] for c in with_flops}), 1) if with_flops else 0
  top_h, bottom_h = (4.2 if n_top else 0), (1.2 + 0.32 * len(bytes_only) if bytes_only else 0)
  fig = plt.figure(
    figsize=(max(5.0 * n_top, 9.0), top_h + bottom_h + 0.9), dpi=DPI, layout="constrained"
  )
  subfigs = fig.subfigures(
    2 if n_top and bytes_only else 1, 1, height_ratios=[h for h in (top_h, bottom_h) if h] or None
  )
  subfigs = list(subfigs) if hasattr(subfigs, "__len__") else [subfigs]
  roof = _flops_panels(fig, subfigs.pop(0), with_flops, peaks) if n_top else []
  if bytes_only:
    if bw and not (n_top and fl):  # else the roofs entry stands for this line too
      roof.append(
        Line2D([], [], color="k", ls="--", lw=1, label=f"bandwidth ({peaks.get('source')})")
      )
    _bytes_panel(subfigs.pop(0), bytes_only, bw)
  note = "" if (bw or fl) else "  —  no device peaks known (CPU, interpreter): no roofs"
  fig.legend(
    handles=_legend_handles(roof), loc="outside upper center", ncols=min(len(roof) + 2, 6), fontsize=8,
    title=f"same case: kernel and reference joined by a line{note}", title_fontsize=8,
  )  # fmt: skip
  fig.savefig(path)
  plt.close(fig)
  return path


def _flops_panels(fig, sub, with_flops: list[dict], peaks: dict) -> list:
  """One roofline panel per op (cases with a flop count); returns the legend's extra handles."""
  bw, fl = peaks.get("hbm_bytes_per_s"), peaks.get("bf16_flops_per_s")
  by_op = collections.defaultdict(list)
  for c in with_flops:
    by_op[c["op"]].append(c)
  sub.suptitle("ops with a flop count: achieved FLOP/s vs arithmetic intensity", fontsize=10)
  axes = sub.subplots(1, len(by_op), sharex=True, sharey=True, squeeze=False)[0]
  xs = [c["flops"] / c["bytes"] for c in with_flops]
  lo, hi = min(xs) / 10, max(xs) * 10  # a decade each side: room for the outer labels
  if bw and fl:
    lo, hi = min(lo, fl / bw / 3), max(hi, fl / bw * 3)
  for ax, (op, rows) in zip(axes, sorted(by_op.items())):
    _roofline_panel(ax, op, rows)
    if bw and fl:
      ax.plot([lo, fl / bw, hi], [lo * bw, fl, fl], "k--", lw=1, zorder=0)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), title=op, xlabel="flop / ideal byte")
    ax.title.set_fontsize(9)
    ax.grid(True, which="major", alpha=0.3)
    ax.margins(y=0.25)
  axes[0].set_ylabel("achieved FLOP/s")
  fig.canvas.draw()  # text extents exist only after a draw
  for ax in axes:
    _declutter(ax, list(ax.texts))
  modes = dict.fromkeys(c["mode"] for c in with_flops)
  roof = [
    Line2D([], [], marker=MODE_MARKER.get(m, "D"), color="0.45", ls="none", label=m) for m in modes
  ]
  if bw and fl:
    roof.append(Line2D([], [], color="k", ls="--", lw=1, label=f"roofs ({peaks.get('source')})"))
  return roof


def _roofline_panel(ax, op: str, rows: list[dict]) -> None:
  """One op's cases: kernel (filled) and reference (hollow) joined, one label per shape."""
  shapes = collections.defaultdict(list)
  for c in rows:
    x = c["flops"] / c["bytes"]
    yk, yr = c["flops"] / _median(c, "kernel"), c["flops"] / _median(c, "reference")
    marker = MODE_MARKER.get(c["mode"], "D")
    ax.plot([x, x], [yk, yr], color="0.6", lw=1, zorder=1)
    ax.plot([x], [yr], **dict(REFERENCE, marker=marker), zorder=2)
    ax.plot([x], [yk], **dict(KERNEL, marker=marker), zorder=3)
    shapes[c["shape"]].append((x, yk))
  # one label per shape (its modes differ by marker), shapes alternating left and right in order
  # of intensity, so a label does not run into the next shape's points
  for j, (shape, pts) in enumerate(sorted(shapes.items(), key=lambda kv: min(kv[1])[0])):
    side = 1 if j % 2 else -1
    x = max(p[0] for p in pts) if side > 0 else min(p[0] for p in pts)
    y = math.exp(sum(math.log(p[1]) for p in pts) / len(pts))
    ax.annotate(
      shape, (x, y), xytext=(9 * side, 0), textcoords="offset points", va="center",
      ha="left" if side > 0 else "right", fontsize=7,
    )  # fmt: skip


def _bytes_panel(sub, bytes_only: list[dict], bw) -> None:
  """Bandwidth-bound ops (no flop count): achieved bytes/s per case against the bandwidth line."""
  sub.suptitle("bandwidth-bound ops (no flop count): ideal bytes / median time", fontsize=10)
  ax = sub.subplots()
  rows = list(reversed(bytes_only))  # first case at the top
  for i, c in enumerate(rows):
    xk, xr = c["bytes"] / _median(c, "kernel"), c["bytes"] / _median(c, "reference")
    ax.plot([xk, xr], [i, i], color="0.6", lw=1, zorder=1)
    ax.plot([xr], [i], **REFERENCE, zorder=2)
    ax.plot([xk], [i], **KERNEL, zorder=3)
  if bw:
    ax.axvline(bw, color="k", ls="--", lw=1)
  ax.set_yticks(range(len(rows)), [c["name"] for c in rows], fontsize=8)
  ax.set(xscale="log", xlabel="achieved bytes/s", ylim=(-0.7, len(rows) - 0.3))
  ax.grid(True, which="major", axis="x", alpha=0.3)


def modelled_chart(cases: list[dict], env: dict, path: pathlib.Path) -> pathlib.Path:
  """A compiled report's times, all *modelled* or XLA's *compiled* cost model, never measured: per
  case the kernel's compute floor (static schedule) and memory floor (ideal bytes / bandwidth), and
  XLA's optimal time for the reference, on one log axis."""
  rows = [c for c in cases if (c.get("compiled") or {}).get("model", {}).get("modelled_s")]
  fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(rows)), dpi=DPI, layout="constrained")
  series = (
    ("kernel compute floor (modelled: bundles / clock)", "tab:blue", lambda m, c: m["compute_s"]),
    ("memory floor (modelled: ideal bytes / HBM bandwidth)", "0.5", lambda m, c: m["memory_s"]),
    ("reference: XLA optimal time (compiled cost model)", "tab:orange",
     lambda m, c: c["reference"].get("cost", {}).get("optimal_s")),
  )  # fmt: skip
  for j, (label, color, get) in enumerate(series):
    ys = [i + (j - 1) * 0.25 for i in range(len(rows))]
    # a figure that is not a time (XLA's cost model can give a negative one) is not drawn
    vals = [max(get(r["compiled"]["model"], r["compiled"]) or 0, 0) for r in rows]
    ax.barh(ys, vals, height=0.25, color=color, label=label)
  ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
  ax.invert_yaxis()
  ax.set(xscale="log", xlabel="seconds (modelled / compiled; not measured)")
  ax.set_title(f"compiled for {env['target']}: {env['label']}", fontsize=9)
  ax.legend(fontsize=7, loc="lower right")
  ax.grid(True, which="major", axis="x", alpha=0.3)
  fig.savefig(path)
  plt.close(fig)
  return path


def time_vs_size(cases: list[dict], path: pathlib.Path) -> pathlib.Path:
  families = collections.defaultdict(list)
  for c in timed(cases):
    families[c["op"].split("/")[0]].append(c)
  widest = max((len(v) for v in families.values()), default=1)
  fig = plt.figure(
    figsize=(max(6.0, 1.0 * widest + 1.8), 3.0 * max(len(families), 1) + 0.8), dpi=DPI,
    layout="constrained",
  )  # fmt: skip
  # one row per op family, one grid column per case: every panel has the same spacing per case
  grid = fig.add_gridspec(max(len(families), 1), max(widest, 2))
  for row, (family, rows) in enumerate(sorted(families.items())):
    span = max(len(rows), 2)  # a lone case gets two columns, centred: room for its labels
    ax = fig.add_subplot(grid[row, :span])
    # variants together, each by mode, then by size
    rows = sorted(rows, key=lambda c: (c["op"], c["mode"], c["bytes"] or 0))
    for i, c in enumerate(rows):
      for dx, (side, style, _) in zip((-0.12, 0.12), SIDES):
        lo, hi = spread(c[side]["timing"])
        med = c[side]["timing"]["median_s"]
        ax.errorbar(
          [i + dx], [med], yerr=[[med - lo], [hi - med]], capsize=2, elinewidth=0.8, **style
        )
      top = max(spread(c[s]["timing"])[1] for s, _, _ in SIDES)
      ax.annotate(
        f"{c['speedup']:.2f}x", (i, top), xytext=(0, 5), textcoords="offset points",
        ha="center", fontsize=7, color=_speedup_color(c["speedup"]),
      )  # fmt: skip
    labels = ["\n".join([*c["op"].split("/")[1:], c["shape"], f"{c['mode']}, {_mib(c['bytes'])}"])
              for c in rows]  # fmt: skip
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(
      yscale="log",
      ylabel="median time (s)",
      xlim=(-0.5 - (span - len(rows)) / 2, len(rows) - 0.5 + (span - len(rows)) / 2),
    )
    ax.set_title(family, fontsize=9, loc="left")
    ax.margins(y=0.3)
    ax.grid(True, which="major", axis="y", alpha=0.3)
  fig.legend(
    handles=_legend_handles(), loc="outside upper center", ncols=2, fontsize=8,
    title="median time per case (whiskers: quartiles; fastest to slowest repeat in reports that "
    "predate quartiles)\nabove: speedup = "
    "reference / kernel (green: kernel faster, red: slower); below: the case, its ideal bytes", title_fontsize=8,
  )  # fmt: skip
  fig.savefig(path)
  plt.close(fig)
  return path


def _speedup_color(speedup: float) -> str:
  text = f"{speedup:.2f}"  # coloured as printed: "1.00x" is a tie, not a loss
  return "0.35" if text == "1.00" else ("tab:green" if speedup > 1 else "tab:red")


def spread(timing: dict) -> tuple[float, float]:
  """The whiskers around a median: its quartiles, or the fastest and slowest repeat in a report
  written before quartiles were recorded (median +- IQR / 2 could cross zero on a log axis)."""
  if timing.get("q1_s") is not None:
    return timing["q1_s"], timing["q3_s"]
  return timing["min_s"], timing["max_s"]


def _mib(b) -> str:
  return "-" if not b else f"{b / 2**20:.3g} MiB"


def rollout_chart(rows: list[dict], path: pathlib.Path) -> pathlib.Path:
  workloads = sorted({r["workload"] for r in rows})
  backends = list(dict.fromkeys(r["backend"] for r in rows))
  by = {(r["workload"], r["backend"]): r for r in rows}
  fig, ax = plt.subplots(figsize=(6.5, 4), dpi=DPI, layout="constrained")
  width = 0.8 / len(backends)
  for j, b in enumerate(backends):
    xs = [i + j * width for i in range(len(workloads))]
    bars = ax.bar(xs, [by[(w, b)]["tokens_per_s"] if (w, b) in by else 0.0 for w in workloads],
                  width, label=b)  # fmt: skip
    for bar, w in zip(bars, workloads):
      if (w, b) in by and not by[(w, b)]["ok"]:
        bar.set_hatch("//")  # failed parity: a fast wrong engine must not look like a win
  ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(workloads))], workloads)
  ax.set(
    ylabel="generated tokens / s (median)", title="rollout throughput per engine (higher is better)"
  )
  ax.legend(fontsize=8)
  fig.savefig(path)
  plt.close(fig)
  return path
