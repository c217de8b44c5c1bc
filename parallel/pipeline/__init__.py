"""Pipeline parallelism: stage partitioning, schedules (GPipe, 1F1B, interleaved 1F1B), p2p, the engine."""
