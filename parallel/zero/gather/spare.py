"""ZeRO-3's freed parameter memory, kept for the next gather of the same size (CPU only).

Why: a gathered unit's full buffer is freed after its forward and gathered again before its backward, 17 times
per step for an 8-block GPT. On the CPU a buffer of a block's size (50 MB for 8 x 1024 in fp32) is an mmap of its
own, so each free returns it to the OS and each gather page-faults every page in again (the kernel zero-fills
them): measured on benchmarks/zero.py's memory-bound model, 2.28 GB of page faults per step per rank against DDP's
1.54 GB, the difference about 17 gathered blocks (benchmarks/zero3_profile.py). On CUDA the caching allocator
already reuses freed blocks, so the cache is not used there.

How: a storage's memory moves between storage objects with `_swap_data_ptr_`, so the parameters (views of the
unit's flat buffer, and autograd's saved references to them) never change; only the memory under them does.
`free` parks a unit's memory here instead of releasing it; `fill` gives a freed storage memory of exactly its size,
from a parked one when there is one. At most `limit` bytes are parked and a miss releases every parked storage
before the new allocation, so the peak is never above freeing at once: the next gather (the prefetch of the unit
after the one just freed) takes what the free parked. `clear()` (end of backward, end of a no-grad forward)
releases everything, so nothing is held between steps.
"""

from __future__ import annotations

import torch


class SpareStorages:
    def __init__(self, limit: int):
        self.limit = limit  # bytes: one unit's largest bucket set (the caller's choice)
        self._parked: list[torch.UntypedStorage] = []
        self.hits = self.misses = 0  # tests and the profile read these

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._parked)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give `storage` (0 bytes) `nbytes` of memory, uninitialised."""
        for i, spare in enumerate(self._parked):
            if spare.nbytes() == nbytes:
                storage._swap_data_ptr_(self._parked.pop(i))  # the popped object now holds 0 bytes
                self.hits += 1
                return
        self.clear()  # released before the new allocation, never held beside it
        storage.resize_(nbytes)
        self.misses += 1

    def free(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory away from it (it holds 0 bytes afterwards), parking it when it fits."""
        if storage.device.type != "cpu" or storage.nbytes() == 0 or storage.nbytes() + self.nbytes() > self.limit:
            storage.resize_(0)
            return
        parked = torch.UntypedStorage(0, device=storage.device)
        storage._swap_data_ptr_(parked)
        self._parked.append(parked)

    def clear(self) -> None:
        for s in self._parked:
            s.resize_(0)
        self._parked.clear()
