"""Step metrics: console progress, metrics.jsonl and wandb."""
