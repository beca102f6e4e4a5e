"""``python -m bench`` (what ``nox -s bench`` runs): every suite's cases, kernel vs reference.

Examples::

    python -m bench                                  # this backend's default sizes
    python -m bench --suite grpo_loss --size large   # real shapes (for a GPU / TPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import sys

from tqdm import tqdm

from bench import report, roofline
from bench.cases import SIZES, SUITES, all_cases
from bench.run import run_case
from kernels import backend


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  suites: tuple[str, ...] | None = None  # None: every suite
  size: str | None = None  # None: "small" on CPU, "large" on GPU / TPU
  repeats: int = 10
  warmup: int = 2
  seed: int = 0
  measure_bandwidth: bool = True
  out: pathlib.Path | None = None  # default bench/results/<device>-<timestamp>

  def __post_init__(self):
    if self.repeats < 1 or self.warmup < 0:
      raise ValueError("repeats must be >= 1 and warmup >= 0")
    if self.size is not None and self.size not in SIZES:
      raise ValueError(f"size must be one of {SIZES}")


def parse_args(argv=None) -> BenchConfig:
  p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
  p.add_argument("--suite", action="append", choices=SUITES, help="repeatable; default: all suites")
  p.add_argument("--size", choices=SIZES)
  p.add_argument("--repeats", type=int, default=BenchConfig.repeats)
  p.add_argument("--warmup", type=int, default=BenchConfig.warmup)
  p.add_argument("--seed", type=int, default=BenchConfig.seed)
  p.add_argument("--no-measure-bandwidth", action="store_true", help="use datasheet peaks only")
  p.add_argument("--out", type=pathlib.Path)
  a = p.parse_args(argv)
  return BenchConfig(tuple(a.suite) if a.suite else None, a.size, a.repeats, a.warmup, a.seed,
                     not a.no_measure_bandwidth, a.out)


def main(argv=None) -> int:
  cfg = parse_args(argv)
  target = backend.resolve()
  size = cfg.size or ("small" if target.platform == "cpu" else "large")
  cases = all_cases(size, target.platform, cfg.suites)
  peaks = roofline.peaks_for(measure=cfg.measure_bandwidth)
  env = report.environment(peaks, target.platform, target.interpret)
  print(f"{len(cases)} cases at size '{size}' on {env['device_kind']} (jax {env['jax']}, kernel target "
        f"{target.platform}{', interpret mode' if target.interpret else ''})", flush=True)
  results = []
  for case in (bar := tqdm(cases, unit="case", file=sys.stderr)):
    bar.set_description(case.name)
    results.append(run_case(case, peaks, seed=cfg.seed, warmup=cfg.warmup, repeats=cfg.repeats))
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  kind = env["device_kind"].replace(" ", "_").replace("/", "_")
  out = cfg.out or pathlib.Path(__file__).resolve().parent / "results" / f"{target.platform}-{kind}-{stamp}"
  report.write(out, env, results)
  print(report.markdown_table(results))
  print(f"\nwrote {out / 'results.json'} and {out / 'summary.md'}")
  failed = [r.name for r in results if not r.ok]
  if failed:
    print(f"FAILED (parity or error): {failed}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  raise SystemExit(main())
