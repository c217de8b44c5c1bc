"""Tensor (intra-layer) model parallelism, Megatron-LM style."""

from megazoo.parallel.tensor.comms import (copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
                                   scatter_to_tp_region)
from megazoo.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megazoo.parallel.tensor.init import normal_shard_
from megazoo.parallel.tensor.shards import ShardSpec, gather_full, shard_of
from megazoo.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megazoo.parallel.tensor.random import TPRNGTracker

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ShardSpec", "TPRNGTracker",
    "copy_to_tp_region", "gather_from_tp_region", "gather_full", "shard_of", "normal_shard_", "reduce_from_tp_region",
    "scatter_to_tp_region", "vocab_parallel_cross_entropy",
]
