"""Multi-turn RL, `python -m rl.agent` (rl.agent.__main__: the entry point, `make_run`): episodes of
a text environment rolled out turn by turn, GRPO or PPO over them. The step (rl.agent.step), its
update math with the critic's value loss (rl.agent.update), the critic (rl.agent.critic) and the PPO
pieces: GAE, whitening, the clipped value loss (rl.agent.ppo)."""
