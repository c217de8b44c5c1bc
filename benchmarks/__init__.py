"""Benchmark scripts (run as `python -m benchmarks.<name>`): they print markdown tables and JSON, never assert."""
