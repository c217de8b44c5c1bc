"""Parallelism: the explicit Topology and one folder per strategy (tensor/, zero/, pipeline/)."""
