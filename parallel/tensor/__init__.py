"""Tensor (intra-layer) model parallelism, Megatron-LM style."""

from megazoo.parallel.tensor.comms import (copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
                                            scatter_to_tp_region)
from megazoo.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megazoo.parallel.tensor.init import normal_shard_
from megazoo.parallel.tensor.shards import (ShardSpec, full_state_dict, gather_full, named_shards, shard_of,
                                            unique_named_shards)
from megazoo.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megazoo.parallel.tensor.random import TPRNGTracker
from megazoo.parallel.tensor.sequence import SequenceParallel

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SequenceParallel", "ShardSpec", "TPRNGTracker",
    "copy_to_tp_region", "full_state_dict", "gather_from_tp_region", "gather_full", "named_shards",
    "unique_named_shards", "shard_of", "normal_shard_", "reduce_from_tp_region",
    "scatter_to_tp_region", "vocab_parallel_cross_entropy",
]
