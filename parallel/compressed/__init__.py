"""Compressed communication for slow networks: 1-bit Adam and 0/1 Adam over ZeRO stage 0 (data parallelism) or 1.

packing.py    sign bits 8 per byte + one scale per chunk, in torch ops
comms.py      the two-stage compressed all-reduce (all-to-all + all-gather) with worker and server error feedback
schedule.py   the settings and the step policy (warm-up, 0/1 Adam's variance and local-step intervals)
optimizer.py  CompressedAdam: the ZeroOptimizer (stage 0) that runs AdamW, 1-bit Adam or 0/1 Adam
zero1.py      CompressedAdamZero1: the same steps with the optimizer states partitioned over dp (ZeRO-1)
"""
