"""The end-to-end GRPO loop (model, rollout, rewards, update). Not built yet: see the open issues."""
