"""Sharded, topology-independent checkpoints: what each rank owns, written in parallel, loadable anywhere."""
