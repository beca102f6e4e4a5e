"""The end-to-end GRPO loop. `python -m rl.train` (rl.train: single-turn GRPO, its step rl.step, the
update rl.update with its optimizer rl.optimizer, advantages and the training-inference mismatch)
and `python -m rl.agent` (rl/agent: multi-turn episodes, GRPO or PPO) share their command line
(rl.cli) and the run around a step (rl/run). The rest by concern: rl/config (the typed configuration
tree; rl.configlib its YAML machinery), rl/model (the Qwen decoder), rl/rollout (the engines),
rl/data (the task's text, tokenizer and rewards), rl/env (text environments), rl/logging (metric
sinks), rl/aot (compiled programs and `--check`, nothing allocated) and the device mesh
(rl.sharding, rl.kernel_sharding). The manual: docs/training.md.
"""
