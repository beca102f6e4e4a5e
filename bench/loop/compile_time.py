"""Compile time of the loop's two big programs, ahead of time, from abstract inputs.

`python -m bench.loop.compile_time [--config configs/gpu-qwen2.5-0.5b.yaml] [key=value ...]` traces,
lowers and compiles for this host's backend (XLA:CPU here) (a) the GRPO train step the loop builds
(`rl.update.train_step` with the config's loss and optimizer) and (b) the rollout's decode chunk
(`rl.rollout.steps.decode_chunk` over the paged cache at the config's slots, pages and steps per sync),
with `jax.ShapeDtypeStruct` inputs: no weight, cache or batch is materialised and nothing runs.
Prints a table and writes JSON (`--out`). Each program is compiled in a fresh process-wide cache
state (jax's caches are cleared first), so the figures do not depend on the order.

The prompt width is `--prompt-width` (default: the widest prompt the config's rollout admits,
rollout.max_seq_len - sampling.max_new_tokens), the completion width sampling.max_new_tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence

import jax

from rl import configlib
from rl.aot import check
from rl.config import GRPOConfig
from rl.model import preset

DEFAULT_CONFIG = "configs/gpu-qwen2.5-0.5b.yaml"


def aot_seconds(jitted, *args) -> dict[str, float]:
  """Wall seconds of trace, lower and compile of one `jax.jit` object at `args` (abstract or
  concrete), and the process CPU seconds of the whole (`cpu_s`: steadier than wall time on a shared
  machine, where waiting for a core inflates the wall figures)."""
  jax.clear_caches()
  c0, t0 = time.process_time(), time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3, c3 = time.perf_counter(), time.process_time()
  return {
    "trace_s": t1 - t0,
    "lower_s": t2 - t1,
    "compile_s": t3 - t2,
    "total_s": t3 - t0,
    "cpu_s": c3 - c0,
  }


def measure(cfg: GRPOConfig, prompt_width: int, only: Sequence[str] = ()) -> dict:
  model_cfg = preset(cfg.model.preset, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
  impl = cfg.train.policy_loss_impl
  # the programs --check lowers, at the global micro-batch (one host's share on one device)
  programs = {
    "train_step": lambda: check.train_step_program(
      cfg, model_cfg, prompt_width, impl, cfg.global_micro_batch
    ),
    "decode_chunk": lambda: check.decode_chunk_program(cfg, model_cfg),
  }
  results = {}
  for name, build in programs.items():
    if only and name not in only:
      continue
    fn, args = build()
    results[name] = aot_seconds(fn, *args)
  return results


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=DEFAULT_CONFIG)
  parser.add_argument("--prompt-width", type=int, default=None)
  parser.add_argument("--only", nargs="*", default=(), choices=("train_step", "decode_chunk"))
  parser.add_argument("--out", default=None, help="write the JSON report here")
  parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
  args = parser.parse_args(argv)
  cfg = configlib.load(GRPOConfig, args.config, args.overrides).resolved(1)
  width = args.prompt_width
  if width is None:
    width = cfg.rollout.max_seq_len - cfg.sampling.max_new_tokens
  if width < 1:
    raise ValueError(f"--prompt-width must be >= 1, got {width}")
  results = measure(cfg, width, args.only)
  report = {
    "config": args.config,
    "overrides": list(args.overrides),
    "preset": cfg.model.preset,
    "prompt_width": width,
    "completion_width": cfg.sampling.max_new_tokens,
    "batch_km": [cfg.grad_accum_steps, cfg.global_micro_batch],
    "decode": {"slots": cfg.rollout.max_slots, "steps": cfg.rollout.steps_per_sync},
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "host": platform.node(),
    "programs": results,
  }
  print(
    f"{'program':<14}{'trace s':>10}{'lower s':>10}{'compile s':>12}{'total s':>10}{'cpu s':>10}"
  )
  for name, r in results.items():
    print(
      f"{name:<14}{r['trace_s']:>10.2f}{r['lower_s']:>10.2f}{r['compile_s']:>12.2f}"
      f"{r['total_s']:>10.2f}{r['cpu_s']:>10.2f}"
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)
  return report


if __name__ == "__main__":
  main()
