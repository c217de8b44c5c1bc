"""What fits and how fast: ZeRO's formulas, per-device shards, activations, fit, cost model, FLOPs, the dry run."""
