"""Which sample indices each data-parallel rank reads at each optimizer step.

The layout makes the global batch independent of how it is split: step s always covers the same GB samples,
and dp rank r takes a contiguous slice of them, cut into grad_accum micro-batches. So dp=2 x micro b reads
exactly what dp=1 x micro 2b reads, and accum 2 x b what accum 1 x 2b reads: every parallel configuration
trains on the same data. A step number is the whole data position, so resuming is starting at step k.
"""

import numpy as np


class GlobalBatchSampler:
    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        for name, value in [("micro_batch", micro_batch), ("grad_accum", grad_accum), ("dp_size", dp_size)]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        product = micro_batch * grad_accum * dp_size
        if global_batch != product:
            raise ValueError(
                f"global_batch={global_batch} must equal micro_batch x grad_accum x dp_size = "
                f"{micro_batch} x {grad_accum} x {dp_size} = {product}"
            )
        if num_samples < global_batch:
            raise ValueError(f"num_samples={num_samples} is smaller than global_batch={global_batch}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        # Each epoch drops its last num_samples % GB samples, which the next epoch's permutation reshuffles.
        self.steps_per_epoch = num_samples // global_batch
        self._cached_order: tuple[int, np.ndarray] | None = None  # (epoch, order): steps run epoch by epoch

    def indices_for_step(self, step: int) -> list[list[int]]:
        """grad_accum micro-batches of micro_batch sample indices for this rank at optimizer step `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        global_start = step_in_epoch * self.global_batch
        per_rank = self.micro_batch * self.grad_accum
        start = global_start + self.dp_rank * per_rank
        rank_indices = self._epoch_order(epoch)[start : start + per_rank].tolist()
        return [rank_indices[i : i + self.micro_batch] for i in range(0, per_rank, self.micro_batch)]

    def global_indices_for_step(self, step: int) -> list[int]:
        """Every sample index of optimizer step `step`, all dp ranks' together."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        start = step_in_epoch * self.global_batch
        return self._epoch_order(epoch)[start : start + self.global_batch].tolist()

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._cached_order is None or self._cached_order[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._cached_order = (epoch, order)
        return self._cached_order[1]
