"""The GRPO loop around the kernels: `python -m rl.train` (single-turn GRPO) and `python -m rl.agent`
(multi-turn episodes, GRPO or PPO with a critic).

The Qwen-family model (`rl.model`), rollout engines (`rl.rollout`: paged, dense, sglang-jax), data
(`rl.data`), rewards, environments (`rl.env`), the update through the loss and optimizer kernels, the
run around the steps (set-up, SFT warm-up, evals, metrics, checkpoints and exact resume), and the
typed configuration tree (`rl.config`) checked before anything compiles. The manual: docs/training.md.
"""
