"""One training run: the Trainer (steps, not mechanisms), checkpointing, model and data setup, metrics, progress."""
