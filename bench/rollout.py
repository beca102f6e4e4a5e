"""Rollout throughput: generated tokens/s of the paged engine against the dense reference sampler, in
the same run, on a random model of a real preset's shape (no checkpoint needed).

    python -m bench.rollout                       # CPU: the tiny model, small batch
    python -m bench.rollout --size large          # GPU/TPU: Qwen2.5-0.5B shape, 128 x (256 + 512)

Two workloads: `fixed` (every completion runs to max_new_tokens: the engines do the same decode work,
so the difference is attention over pages vs the whole dense cache, and the shared group prefill) and
`varied` (per-request max_new_tokens drawn from [max_new/8, max_new], as GRPO completions end at
different lengths: continuous batching refills finished slots, a static batch waits for its longest).
Each backend runs once to compile, then `repeats` timed runs; the median is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import statistics
import sys

import jax
import numpy as np

from rl.model import init_model, preset
from rl.rollout import EngineConfig, SamplingParams, make_engine

SIZES = {
    "tiny": dict(model="tiny", prompts=2, n=2, prompt_len=8, new_tokens=8, page_size=8, steps=4),  # tests
    # preset, prompts, samples per prompt, prompt length, new tokens, slots, page size, steps per sync
    "small": dict(model="tiny", prompts=8, n=2, prompt_len=32, new_tokens=64, page_size=16, steps=8),
    "large": dict(model="qwen2.5-0.5b", prompts=32, n=4, prompt_len=256, new_tokens=512, page_size=16,
                  steps=16),
}


@dataclasses.dataclass
class RolloutBenchRow:
  backend: str
  workload: str
  median_s: float
  tokens: int
  tokens_per_s: float
  prefill_s: float
  decode_s: float
  decode_steps: int
  preemptions: int


def workload(size: dict, kind: str, seed: int = 0):
  rng = np.random.default_rng(seed)
  prompts = [list(map(int, rng.integers(3, 200, size=size["prompt_len"]))) for _ in range(size["prompts"])]
  new = size["new_tokens"]
  lens = [new] * len(prompts) if kind == "fixed" else list(map(int, rng.integers(new // 8, new + 1,
                                                                                   len(prompts))))
  params = [SamplingParams(max_new_tokens=m, temperature=1.0, n=size["n"], seed=i) for i, m in enumerate(lens)]
  return prompts, params


def run(size_name: str, repeats: int = 3, backends=("paged", "dense")) -> list[RolloutBenchRow]:
  size = SIZES[size_name]
  model = init_model(preset(size["model"]), seed=0)
  seqs = size["prompts"] * size["n"]
  max_len = size["prompt_len"] + size["new_tokens"]
  rows = []
  for kind in ("fixed", "varied"):
    prompts, params = workload(size, kind)
    for name in backends:
      cfg = EngineConfig(backend=name, max_seq_len=max_len, max_slots=seqs, page_size=size["page_size"],
                         steps_per_sync=size["steps"])
      engine = make_engine(model, cfg, eos_ids=[])  # random weights: run every request to its length
      engine.generate(prompts, params)  # compile
      results = [engine.generate(prompts, params) for _ in range(repeats)]
      times = [r.stats.total_s for r in results]
      mid = results[int(np.argsort(times)[len(times) // 2])].stats
      rows.append(RolloutBenchRow(name, kind, statistics.median(times), mid.generated_tokens,
                                  mid.generated_tokens / statistics.median(times), mid.prefill_s, mid.decode_s,
                                  mid.decode_steps, mid.preemptions))
  return rows


def markdown(rows: list[RolloutBenchRow]) -> str:
  lines = ["| workload | backend | median s | tokens | tokens/s | prefill s | decode s | decode steps | "
           "speedup vs dense |", "|---|---|---|---|---|---|---|---|---|"]
  dense = {r.workload: r.tokens_per_s for r in rows if r.backend == "dense"}
  for r in rows:
    speed = f"{r.tokens_per_s / dense[r.workload]:.2f}x" if dense.get(r.workload) else "-"
    lines.append(f"| {r.workload} | {r.backend} | {r.median_s:.3f} | {r.tokens} | {r.tokens_per_s:.1f} | "
                 f"{r.prefill_s:.3f} | {r.decode_s:.3f} | {r.decode_steps} | {speed} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__.split("\n")[0])
  p.add_argument("--size", choices=sorted(SIZES), default=None)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", type=pathlib.Path, default=None, help="write results.json and summary.md here")
  a = p.parse_args(argv)
  size = a.size or ("small" if jax.default_backend() == "cpu" else "large")
  rows = run(size, a.repeats)
  table = markdown(rows)
  print(f"rollout bench, size {size!r} on {jax.devices()[0].device_kind} (jax {jax.__version__})\n{table}")
  if a.out:
    a.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, size=size, config=SIZES[size],
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    (a.out / "results.json").write_text(json.dumps(dict(meta, rows=[dataclasses.asdict(r) for r in rows]),
                                                   indent=2))
    (a.out / "summary.md").write_text(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
