"""`python -m bench`'s configuration: the suites it knows, `BenchConfig` (typed, validated) and the
command line that fills it (`parse_args`), and the `--case` globs' selection (`chosen`)."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import pathlib

from bench.kernels.cases import SIZES, SUITES
from bench.loop import step_time as loop_bench

# the engine suite: tokens/s of paged vs dense generation (bench/rollout/throughput.py)
ROLLOUT = "rollout"
# the GRPO loop's step time, kept in bench/history/loop.jsonl (bench/loop/step_time.py)
LOOP = "loop"
MISMATCH = "mismatch"  # each engine's sampler log-probs against the trainer's (bench/mismatch.py)
# Liger-Kernel / tokamax beside our kernels (bench/kernels/cases/peers.py), each optional
PEERS = "peers"
ALL_SUITES = SUITES + (PEERS, ROLLOUT, MISMATCH, LOOP)  # the default: every suite but tunix's
# tunix's GRPO step compiled with its loss and ours (bench/loop/tunix_memory.py): its own environment
# (google-tunix) and 10-30 minutes a compile, so only when asked for
TUNIX = "tunix"
CHOICES = ALL_SUITES + (TUNIX,)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  suites: tuple[str, ...] | None = None  # None: every suite
  sizes: tuple[str, ...] | None = None  # None: ("small",) on CPU, ("large",) on GPU / TPU
  repeats: int = 10
  warmup: int = 2
  rollout_repeats: int = 3  # whole generate() calls per rollout backend and workload
  seed: int = 0
  measure_bandwidth: bool = True
  out: pathlib.Path | None = None  # default bench/results/<device kind>-<timestamp>
  profile: pathlib.Path | None = None  # capture a jax.profiler trace of the whole run here
  plots: bool = True
  history: pathlib.Path | None = loop_bench.HISTORY  # the loop suite's rows (None: keep none)
  memory_limit_gib: float | None = None  # skip cases XLA says need more (None: the device's limit)
  target: str | None = None  # a TPU generation / slice to compile for ("tpu-v6e", "v5litepod-8")
  cases: tuple[str, ...] | None = (
    None  # globs on kernel case names (None: every case of the suites)
  )

  def __post_init__(self):
    if self.target is not None:
      from kernels import tpu_targets

      tpu_targets.Slice.parse(tpu_slice(self.target))  # ValueError naming the known generations
    if self.cases and self.target is not None:
      raise ValueError(
        "--case picks timed kernel cases; --target compiles whole suites (use --suite)"
      )
    if self.repeats < 1 or self.warmup < 0 or self.rollout_repeats < 1:
      raise ValueError("repeats and rollout_repeats must be >= 1 and warmup >= 0")
    if self.memory_limit_gib is not None and not self.memory_limit_gib > 0:
      raise ValueError(f"memory_limit_gib must be > 0, got {self.memory_limit_gib}")
    unknown = set(self.sizes or ()) - set(SIZES)
    if unknown:
      raise ValueError(f"size must be one of {SIZES}, got {sorted(unknown)}")
    unknown = set(self.suites or ()) - set(CHOICES)
    if unknown:
      raise ValueError(f"suite must be one of {CHOICES}, got {sorted(unknown)}")


def parse_args(argv=None) -> BenchConfig:
  p = argparse.ArgumentParser(
    prog="python -m bench", description="every suite, kernel vs reference, one report"
  )
  p.add_argument(
    "--suite",
    action="append",
    choices=CHOICES,
    help=f"repeatable; default: all suites but {TUNIX}",
  )
  p.add_argument(
    "--size", action="append", choices=SIZES, help="repeatable; default: small on CPU, else large"
  )
  p.add_argument("--repeats", type=int, default=BenchConfig.repeats)
  p.add_argument("--warmup", type=int, default=BenchConfig.warmup)
  p.add_argument("--rollout-repeats", type=int, default=BenchConfig.rollout_repeats)
  p.add_argument("--seed", type=int, default=BenchConfig.seed)
  p.add_argument(
    "--case",
    action="append",
    metavar="GLOB",
    help="repeatable; time only the kernel cases whose name matches (e.g. 'optim/adamw-*')",
  )
  p.add_argument("--no-measure-bandwidth", action="store_true", help="use datasheet peaks only")
  p.add_argument("--no-plots", action="store_true")
  p.add_argument(
    "--no-history", action="store_true", help="the loop suite compares and appends to no history"
  )
  p.add_argument("--out", type=pathlib.Path)
  p.add_argument(
    "--memory-limit-gib",
    type=float,
    help="skip a case whose XLA memory analysis needs more (default: the device's bytes_limit)",
  )
  p.add_argument(
    "--profile",
    nargs="?",
    type=pathlib.Path,
    const=pathlib.Path(""),
    default=None,
    metavar="DIR",
    help="capture a profiler trace (default DIR: profiles/bench-<time>)",
  )
  p.add_argument(
    "--target",
    help="a TPU generation or slice (tpu-v6e, v5e, v4-8): without that TPU here, compile every case "
    "for it and write the compiled report (compiled / modelled figures); on it, measure as usual and "
    "add the modelled times",
  )
  a = p.parse_args(argv)
  try:
    return BenchConfig(
      tuple(dict.fromkeys(a.suite)) if a.suite else None,
      tuple(dict.fromkeys(a.size)) if a.size else None,
      a.repeats,
      a.warmup,
      a.rollout_repeats,
      a.seed,
      not a.no_measure_bandwidth,
      a.out,
      a.profile,
      not a.no_plots,
      None if a.no_history else loop_bench.HISTORY,
      a.memory_limit_gib,
      a.target,
      tuple(dict.fromkeys(a.case)) if a.case else None,
    )
  except ValueError as e:  # the message alone, exit status 2 (argparse's usage error)
    p.error(str(e))


def tpu_slice(target: str) -> str:
  """A --target value as a slice name: "tpu-v6e" -> "v6e" ("tpu7x-8" is a slice name already)."""
  t = target.strip().lower()
  return t[4:] if t.startswith("tpu-") else t


def chosen(cases: list, globs: tuple[str, ...] | None) -> list:
  """The cases whose name matches one of `globs` (None: all). A glob that matches none of them is
  a ValueError naming it and the names it could have matched, before anything compiles."""
  if globs is None:
    return cases
  names = [c.name for c in cases]
  for g in globs:
    if not fnmatch.filter(names, g):
      raise ValueError(
        f"--case {g!r} matches no kernel case of the chosen suites and sizes: {names}"
      )
  return [c for c in cases if any(fnmatch.fnmatchcase(c.name, g) for g in globs)]
