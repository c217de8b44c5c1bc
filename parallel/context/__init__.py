"""Context (sequence) parallelism: the sequence of every micro-batch split over the cp ranks of the Topology.

layout.py: the load-balanced causal split (chunks i and 2cp - 1 - i) and the position ids that follow it.
attention.py: all-to-all (Ulysses) and ring attention over the split. comms.py: their collectives.
"""

from megazoo.parallel.context.attention import ALGORITHMS, context_attention, ring_attention, ulysses_attention
from megazoo.parallel.context.comms import (all_reduce_count, attention_comm_bytes, head_to_seq_shards,
                                            seq_to_head_shards)
from megazoo.parallel.context.layout import (check_context_layout, chunk_ids, gathered_positions, positions,
                                             split_sequence)

__all__ = ["ALGORITHMS", "all_reduce_count", "attention_comm_bytes", "check_context_layout", "chunk_ids",
           "context_attention", "gathered_positions", "head_to_seq_shards", "positions", "ring_attention",
           "seq_to_head_shards", "split_sequence", "ulysses_attention"]
