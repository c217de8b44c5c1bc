"""`megazoo reproduce`: the published tables and plots, regenerated from the planner and the benchmarks."""
