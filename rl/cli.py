"""The command line of `python -m rl.train` and `python -m rl.agent`: arguments -> a checked config (the
keys the entry point reads, the loss impl its platform has), `--check`, the process set-up, and the exit
statuses (a config error: its message alone and status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from kernels.backend import host_platform
from rl import configlib, sharding
from rl.aot import check, slice_check
from rl.config import GRPOConfig, check_entry, platform
from rl.configlib import ConfigError
from rl.run.checkpointing import CheckpointError
from rl.update import NonFiniteError


def arg_parser(prog: str = "python -m rl.train", doc: str = "") -> argparse.ArgumentParser:
  """The command line of `python -m rl.train` and `python -m rl.agent`: --config, overrides,
  --resume, --check and the platform flags."""
  ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
  ap.add_argument(
    "--config", help="a YAML config (configs/*.yaml); defaults apply to what it omits"
  )
  ap.add_argument(
    "--resume", action="store_true", help="continue from the newest checkpoint in run.out_dir"
  )
  ap.add_argument(
    "--check",
    action="store_true",
    help="check the config for its platform (configs/gpu-*: gpu, tpu-*: tpu, cpu-*: cpu) and "
    "AOT-lower the train step and the decode chunk there; nothing runs (rl.aot.check)",
  )
  ap.add_argument(
    "--platform", choices=platform.PLATFORMS, help="--check for this platform, not the config's"
  )
  ap.add_argument(
    "--topology",
    help="--check on this TPU slice (v6e-8, v4-16, ...) instead of the config's mesh.topology",
  )
  ap.add_argument("--json", metavar="PATH", help="--check: write the figures to PATH as JSON")
  ap.add_argument(
    "--layers",
    type=int,
    help="--check a reduced-layer twin of the model with this many decoder layers (CI)",
  )
  ap.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.steps=10")
  return ap


def parse_args(
  argv: Sequence[str] | None = None,
  prog: str = "python -m rl.train",
  doc: str = "",
  entry: str | None = None,
) -> GRPOConfig:
  """The config of a command line. With `entry` ("rl.train" / "rl.agent"), a key that entry point
  does not read is an error naming the one that does (rl.config.check_entry)."""
  return config_of(arg_parser(prog, doc).parse_intermixed_args(argv), entry)


def target_platform(args: argparse.Namespace):
  """--check: --platform, else the config file's; a run: this host's (jax starts: after
  start_process only)."""
  if args.check:
    return args.platform or platform.config_platform(args.config)
  return host_platform()


def config_of(args: argparse.Namespace, entry: str | None = None) -> GRPOConfig:
  """The checked GRPOConfig of parsed arguments (the file, then the overrides); with `entry`, keys
  that entry point does not read are an error (rl.config.check_entry)."""
  raw = configlib.read(args.config, args.overrides)
  if entry is not None:
    try:
      check_entry(configlib.given_keys(raw), entry)
    except ValueError as e:
      raise ConfigError(str(e)) from e
  cfg = configlib.build(GRPOConfig, raw)
  if getattr(args, "topology", None):
    try:
      mesh = dataclasses.replace(cfg.mesh, topology=args.topology)
    except ValueError as e:
      raise ConfigError(f"--topology: {e}") from e
    cfg = dataclasses.replace(cfg, mesh=mesh)
  if args.resume:
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
  if args.check:  # a run checks its host's impl when it starts (jax must not start here)
    t = cfg.train
    platform.loss_impl(target_platform(args), t.fused_lm_head, t.policy_loss_impl)
  return cfg


def run_check(args: argparse.Namespace, entry: str) -> dict:
  """--check: rl.aot.check's figures for the config, printed (and written to --json, also when a check
  fails after some were found); its ConfigError propagates."""
  cfg = config_of(args, entry)
  report: dict = {"config": args.config}
  try:
    check.check(cfg, target_platform(args), entry, layers=getattr(args, "layers", None), out=report)
  finally:
    if report.get("slice"):
      print(slice_check.summary(report["slice"]))
    if getattr(args, "json", None):
      write_json(args.json, report)
  brief = {k: v for k, v in report.items() if k != "slice"}
  print(f"{args.config or '(defaults)'}: ok for {report['platform']}: {brief}")
  return report


def write_json(path: str, report: dict) -> None:
  folder = os.path.dirname(path)
  if folder:
    os.makedirs(folder, exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1, default=str)


def start_process(cfg: GRPOConfig) -> None:
  """Before jax touches a device: run.host_devices simulated CPU devices, and (dist.initialize) this
  process joins the multi-process run."""
  dist = cfg.dist
  sharding.initialize_distributed(
    dist.initialize,
    dist.coordinator_address,
    dist.num_processes,
    dist.process_id,
    dist.cpu_collectives,
    cfg.run.host_devices,
  )


def run_cli(argv: Sequence[str] | None, main, prog: str) -> int:
  """`main` for the command line: a config error is its message alone on stderr and exit status 2
  (argparse's status for bad usage), not a traceback around it; a run stopped by non-finite steps or
  with no readable checkpoint to resume is its message and status 1. `rl.agent` passes its own main."""
  try:
    main(argv)
  except ConfigError as e:
    print(f"{prog}: config error: {e}", file=sys.stderr)
    return 2
  except (NonFiniteError, CheckpointError) as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return 1
  return 0
