"""Tests use the library's local launcher (workers/local.py): N forked gloo ranks on this machine."""

from megazoo.workers.local import run_distributed

__all__ = ["run_distributed"]
