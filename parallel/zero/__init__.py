"""ZeRO: optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) partitioned over dp."""

from megazoo.parallel.zero.api import ZeroEngine, default_units  # noqa: E402,F401  ZeRO for any nn.Module
