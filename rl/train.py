"""The GRPO run: `python -m rl.train --config configs/cpu-default.yaml [key.sub=value ...] [--resume]`.

A step reads top to bottom (rl.step.grpo_step): rollout (a group of `group_size` completions per
prompt) -> rewards -> group-normalised advantages -> old / reference log-probs when needed -> one
micro-batched, gradient-accumulated optimizer update per PPO epoch -> the rollout engine sees the new
weights. What is set up once is rl.run.setup's (`build`, `Policy`); the run around the steps (resume, SFT
warm-up, evals, metrics, checkpoints, profile window) is rl.run.loop's.

Everything random is a function of (train.seed, step): the prompts of step s, each prompt's sampling
seed, the SFT batches. Restoring the step from a checkpoint therefore restores the data order and RNG.

A bad config value stops the run before anything compiles: the command prints the message (it names
the key and the allowed values) and exits with status 2. An update with a non-finite loss or gradient
norm is skipped (`train/nonfinite_steps` counts them); `train.max_nonfinite_steps` in a row stop the run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rl.cli import (
  arg_parser,
  config_of,
  run_check,
  run_cli,
  start_process,
)
from rl.config import GRPOConfig
from rl.run.evaluate import before_after_table
from rl.run.loop import Run
from rl.run.setup import Policy, build
from rl.step import GRPOStep

__all__ = ["cli", "main", "make_run"]


def make_run(cfg: GRPOConfig) -> Run:
  """The single-turn GRPO run of `cfg`: its set-up (every config error first), its policy and the
  GRPO step, in rl.run.loop."""
  setup = build(cfg)
  policy = Policy(setup)
  return Run(setup, policy, GRPOStep(setup, policy), "rl.train")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
  """The run (config errors raise ConfigError); `cli` is the command line's wrapper."""
  args = arg_parser(doc=__doc__).parse_intermixed_args(argv)
  if args.check:
    return run_check(args, "rl.train")
  cfg = config_of(args, "rl.train")  # every config value error surfaces here, before jax starts
  start_process(cfg)
  run = make_run(cfg)
  try:
    metrics = run.run()
  finally:
    run.close()
  if run.setup.is_main and "eval_full/accuracy" in metrics:
    if run.baseline is not None:
      print(before_after_table(run.baseline, metrics))
    print(
      f"eval_full/accuracy = {metrics['eval_full/accuracy']:.4f} "
      f"({int(metrics['eval_full/examples'])} examples)"
    )
  return metrics


def cli(argv: Sequence[str] | None = None, main=main, prog: str = "python -m rl.train") -> int:
  """`main` for the command line: a config error is its message alone on stderr and exit status 2
  (argparse's status for bad usage), not a traceback around it; a run stopped by non-finite steps or
  with no readable checkpoint to resume is its message and status 1. `rl.agent` passes its own main."""
  return run_cli(argv, main, prog)


if __name__ == "__main__":
  sys.exit(cli())
