"""Tests use the library's local launcher (parallel/local_launch.py): N forked gloo ranks on this machine."""

from megazoo.parallel.local_launch import run_distributed

__all__ = ["run_distributed"]
