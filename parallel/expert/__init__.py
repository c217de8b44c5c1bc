"""Expert parallelism: the routed experts of every MoE layer split over the ep ranks of the Topology.

comms.py: the uneven all-to-all, the count exchange and decoding's token broadcast (forward / backward table).
dispatch.py: permute tokens by expert, all-to-all them to the ranks holding their experts, run the local experts,
all-to-all back, combine.
layout.py: the resolver's checks of parallel.ep. zero.py: any ZeRO stage with expert weights over their expert-
data-parallel group (ExpertSplitZero).
"""

from megazoo.parallel.accelerator import device_capability  # which GPU the experts' grouped matmul runs on
from megazoo.parallel.collectives import CommLedger  # what the dispatch counts its all-to-all bytes into
from megazoo.parallel.expert.comms import all_to_all_bytes, all_to_all_uneven, exchange_counts, from_first_rank
from megazoo.parallel.expert.dispatch import (ExpertDispatcher, ExpertsFn, check_expert_split, dispatch_combine,
                                             exchange_rows, host_row_counts, local_expert_range)

__all__ = ["CommLedger", "ExpertDispatcher", "ExpertsFn", "all_to_all_bytes", "all_to_all_uneven", "check_expert_split",
           "device_capability", "dispatch_combine", "exchange_counts", "exchange_rows", "from_first_rank",
           "host_row_counts", "local_expert_range"]
