"""Report figures (matplotlib, written next to results.json): the roofline chart, time vs size, rollout.

* roofline.png: every case's kernel and reference as points at (arithmetic intensity = flops / ideal
  bytes, achieved FLOP/s); the device's bandwidth and compute roofs when its peaks are known. Cases with
  no flop count (pure bandwidth ops) are placed by bandwidth instead, on a second panel.
* time_vs_size.png: median time (IQR as error bars) against ideal bytes moved, kernel vs reference, one
  panel per op and mode.
* rollout.png: generated tokens/s per backend and workload.
"""

from __future__ import annotations

import collections
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
import matplotlib.ticker

_STYLE = {
  "kernel": dict(marker="o", color="tab:blue"),
  "reference": dict(marker="s", color="tab:orange"),
}


def _timed(results):
  return [r for r in results if r.kernel is not None]


def roofline_chart(results, peaks: dict, path: pathlib.Path) -> pathlib.Path:
  bw, fl = peaks.get("hbm_bytes_per_s"), peaks.get("bf16_flops_per_s")
  with_flops = [r for r in _timed(results) if r.flops and r.bytes]
  bytes_only = [r for r in _timed(results) if r.bytes and not r.flops]
  panels = [p for p in (("flops", with_flops), ("bytes", bytes_only)) if p[1]]
  fig, axes = plt.subplots(
    1, max(len(panels), 1), figsize=(6.5 * max(len(panels), 1), 5), squeeze=False
  )
  for ax, (kind, rows) in zip(axes.flat, panels):
    for i, r in enumerate(rows):
      for side in ("kernel", "reference"):
        t = getattr(r, side).timing.median_s
        x, y = (r.flops / r.bytes, r.flops / t) if kind == "flops" else (i, r.bytes / t)
        ax.scatter(x, y, **_STYLE[side], label=side if i == 0 else None)
      if kind == "flops":
        ax.annotate(r.name, (r.flops / r.bytes, r.flops / r.kernel.timing.median_s), fontsize=6)
    if kind == "flops":
      if bw and fl:
        xs = sorted(r.flops / r.bytes for r in rows)
        lo, hi = min(xs[0], fl / bw) / 4, max(xs[-1], fl / bw) * 4
        ax.plot(
          [lo, fl / bw, hi], [lo * bw, fl, fl], "k--", lw=1, label=f"roof ({peaks.get('source')})"
        )
      ax.set(
        xscale="log",
        xlabel="arithmetic intensity (flop / ideal byte)",
        ylabel="achieved FLOP/s",
        title="ops with a flop count",
      )
    else:
      if bw:
        ax.axhline(bw, color="k", ls="--", lw=1, label=f"bandwidth ({peaks.get('source')})")
      ax.set_xticks(range(len(rows)), [r.name for r in rows], rotation=60, ha="right", fontsize=6)
      ax.set(
        ylabel="achieved bytes/s (ideal bytes / time)", title="bandwidth-bound ops (no flop count)"
      )
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  if not (bw or fl):
    fig.suptitle("no device peaks known (CPU, interpreter): points only, no roofs", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def time_vs_size(results, path: pathlib.Path) -> pathlib.Path:
  groups = collections.defaultdict(list)
  for r in _timed(results):
    if r.bytes:
      groups[f"{r.op} {r.mode}"].append(r)
  n = max(len(groups), 1)
  cols = min(n, 3)
  fig, axes = plt.subplots(
    -(-n // cols), cols, figsize=(5 * cols, 4 * -(-n // cols)), squeeze=False
  )
  for ax, (title, rows) in zip(axes.flat, sorted(groups.items())):
    rows = sorted(rows, key=lambda r: r.bytes)
    for side in ("kernel", "reference"):
      impls = [getattr(r, side) for r in rows]
      ax.errorbar(
        [r.bytes for r in rows],
        [i.timing.median_s for i in impls],
        yerr=[i.timing.iqr_s / 2 for i in impls],
        label=side,
        capsize=3,
        **_STYLE[side],
      )
    for r in rows:
      ax.annotate(r.shape, (r.bytes, r.kernel.timing.median_s), fontsize=6)
    ax.set(
      xscale="log", yscale="log", xlabel="ideal bytes moved", ylabel="median time (s)", title=title
    )
    ax.xaxis.set_minor_formatter(
      matplotlib.ticker.NullFormatter()
    )  # decades only: minor labels collide
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(groups) :]:
    ax.set_visible(False)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def rollout_chart(rows, path: pathlib.Path) -> pathlib.Path:
  workloads = sorted({r.workload for r in rows})
  backends = list(dict.fromkeys(r.backend for r in rows))
  by = {(r.workload, r.backend): r.tokens_per_s for r in rows}
  fig, ax = plt.subplots(figsize=(6, 4))
  width = 0.8 / len(backends)
  for j, b in enumerate(backends):
    ax.bar(
      [i + j * width for i in range(len(workloads))],
      [by.get((w, b), 0.0) for w in workloads],
      width,
      label=b,
    )
  ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(workloads))], workloads)
  ax.set(ylabel="generated tokens / s (median)", title="rollout throughput")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
