"""Fault-tolerant replica groups on torchft: the recipe section (config.py), the per-step quorum, cross-group
gradient average and heal from a live group (replica.py), straggler detection (stragglers.py); DiLoCo over HSDP's
nodes for slow links (diloco.py, `[diloco]` in config.py)."""
