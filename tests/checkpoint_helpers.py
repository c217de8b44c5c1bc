"""An injected storage fault for the checkpoint read-back tests."""

from __future__ import annotations

import torch.distributed as dist

from megazoo.parallel.checkpoint.readback import HashingWriter


class FlippingWriter(HashingWriter):
    """The injected fault: the bytes meant are hashed, but one byte of the first large write reaches the file
    flipped (a corruption between the writer and the storage). Only on `rank` (None: every rank)."""

    rank: int | None = None

    def write(self, data) -> int:
        mine = self.rank is None or (dist.is_initialized() and dist.get_rank() == self.rank)
        if mine and not getattr(self, "flipped", False) and len(memoryview(data)) > 64:
            self.flipped = True
            self.sha.update(memoryview(data))
            self.bytes += len(memoryview(data))
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0x01
            return self.file.write(bytes(bad))
        return super().write(data)
