"""Fused kernels behind one dispatch (see the kernels issue)."""
