"""How ZeRO-3 fills a unit's gathered buffer: float8 weights with per-weight scales (fp8.py, zero.fp8_all_gather)
and the CPU's reuse of freed gathered memory (spare.py). qwZ's int8 blocks live beside the stage (../quantized.py),
shared with qgZ."""
