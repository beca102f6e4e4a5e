"""The end-to-end GRPO loop: model, rollout, data, rewards (built); the training loop (see the open issues)."""
