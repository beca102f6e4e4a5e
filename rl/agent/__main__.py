"""Multi-turn RL: `python -m rl.agent --config configs/cpu-multiturn.yaml [key.sub=value ...]`.

A step (rl.agent.step.agent_step): `prompts_per_step` environment seeds x `group_size` episodes each,
rolled out turn by turn (rl.rollout.multiturn) -> packed rows whose loss mask holds only model tokens
-> advantages:
  * train.algorithm=grpo: each episode's return, normalised within its seed's group, on every model
    token of the episode;
  * train.algorithm=ppo: GAE over model tokens (rl.agent.ppo) from the value head's (rl.agent.critic) values of the
    pre-update forward, optionally whitened; the value head is trained with the clipped value loss,
    weighted by train.vf_coef, in the same micro-batched, gradient-accumulated update as the policy
    (rl.agent.update).
The policy term is `rl.agent.ppo.policy_loss` (kernels.grpo_loss semantics with per-token advantages). The
packed widths are fixed before step 1 (rl.agent.step.episode_widths): the update compiles once.

Everything else (model, tokenizer, data, engine, optimizer state, metrics writer, checkpoints: rl.run.setup;
the SFT warm-up, non-finite guard, `--resume`, evals and the run loop: rl.run.loop) is shared with rl.train;
checkpoints add the critic and its optimizer state. Several processes (dist.initialize=true) split a
step's environment seeds and eval's layouts between them, as rl.train splits prompts; the update runs
on the global batch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rl import cli as command
from rl.agent.step import AgentStep, EnvFactory
from rl.config import GRPOConfig
from rl.run.loop import Run
from rl.run.setup import Policy, build

__all__ = ["cli", "main", "make_run"]


def make_run(
  cfg: GRPOConfig, env_factory: EnvFactory | None = None, system: str | None = None
) -> Run:
  """The multi-turn run of `cfg`: the shared set-up (no dataset prompt-room check: an episode's
  prompt is an environment observation; its widths are rl.agent.step's), the policy and the agent's
  step over `env_factory` (default: env.name's) with `system` as the system prompt."""
  setup = build(cfg, prompt_room=False)
  policy = Policy(setup)
  return Run(setup, policy, AgentStep(setup, policy, env_factory, system), "rl.agent")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
  """The multi-turn run (config errors raise ConfigError); `cli` is the command line's wrapper."""
  args = command.arg_parser("python -m rl.agent", __doc__).parse_intermixed_args(argv)
  if args.check:
    return command.run_check(args, "rl.agent")
  cfg = command.config_of(args, "rl.agent")
  command.start_process(cfg)
  run = make_run(cfg)
  try:
    metrics = run.run()
  finally:
    run.close()
  if "eval_full/accuracy" in metrics:
    print(f"eval_full/success_rate = {metrics['eval_full/accuracy']:.4f}")
  return metrics


def cli(argv: Sequence[str] | None = None) -> int:
  """`main` for the command line (rl.train.cli: a config error is its message and exit status 2)."""
  return command.run_cli(argv, main, "python -m rl.agent")


if __name__ == "__main__":
  sys.exit(cli())
