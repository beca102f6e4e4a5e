"""What a run records: step timers and the metric sinks (metrics.jsonl, TensorBoard:
rl.logging.metrics), and Weights & Biases as a further sink (`run.wandb`: its config section
rl.logging.wandb_config, the sink rl.logging.wandb_sink, a run's summary read back offline
rl.logging.wandb_summary)."""
