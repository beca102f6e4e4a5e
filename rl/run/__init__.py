"""The run around a step, shared by rl.train and rl.agent: what it sets up once (rl.run.setup), the
loop with its warm-up, evals, metrics rows and profile window (rl.run.loop), the evaluations
(rl.run.evaluate) and the training checkpoints it saves and resumes from (rl.run.checkpointing)."""
