"""ZeRO: optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) partitioned over dp.

The package imports nothing eagerly: `megazoo.parallel.zero.stage12` (or any other piece) loads only what it
needs. `ZeroEngine` and `default_units` (ZeRO for any nn.Module, api.py) are still reachable from here, loaded
on first use.
"""

from __future__ import annotations

import importlib

_LAZY = {"ZeroEngine": "megazoo.parallel.zero.api", "default_units": "megazoo.parallel.zero.api"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
