"""SFT examples -> fixed-length training rows: packed (several examples per row) or padded (one per row).

Every row is `seq_len` model inputs with three aligned (seq_len,) tensors:
- inputs: the examples' tokens back to back, then padding (id 0);
- targets: the next token where it is a response token of the SAME example, else -100 (the ignore index of the
  model's loss and of parallel/tensor/cross_entropy.py): prompt tokens, an example's last token (its "next"
  token would be the following example's first) and padding never count;
- segments: 1, 2, ... for the row's examples, 0 for padding. The model restarts positions at each segment and
  confines attention to it (models/packing.py), so a packed row computes exactly what its examples compute one
  by one, and the sum of its token losses equals theirs.

An example of L tokens (L <= seq_len, data/sft/examples.py rejects longer ones) thus trains on at most L - 1
predictions, exactly as it would alone. Packing is best-fit decreasing (longest first, each into the fullest row
it still fits), deterministic for a given dataset; padding is the fallback (`packing = false`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100  # the loss's ignore index (models/transformer.py GPT.loss, vocab_parallel_cross_entropy)
PAD_ID = 0  # padding inputs: never a target, attended only by padding


class ExampleList:
    """In-memory examples with the SFTDataset interface (`lengths`, `example(i)`, len)."""

    def __init__(self, ids: list[list[int]], masks: list[list[int]]) -> None:
        if len(ids) != len(masks) or any(len(i) != len(m) for i, m in zip(ids, masks)):
            raise ValueError("every example needs one mask value per token")
        self.ids, self.masks = ids, masks
        self.lengths = np.array([len(i) for i in ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.ids[index], np.int64), np.asarray(self.masks[index], np.int64)


def pack_rows(lengths, seq_len: int, packing: bool = True) -> list[list[int]]:
    """Example indices per row. packing: best-fit decreasing, each row's examples in index order; else one each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.max() > seq_len:
        worst = int(np.argmax(lengths))
        raise ValueError(f"example {worst} has {int(lengths[worst])} tokens, more than seq_len {seq_len}: "
                         "rebuild the dataset with this --seq-len or raise train.seq_len")
    if not packing:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: the fullest row that fits is found by bisect
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        need = int(lengths[i])
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - need > 0:
            bisect.insort(free, (room - need, row))
    return [sorted(row) for row in rows]


def example_targets(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(L,) next-token targets of one example: ids[i + 1] where mask[i + 1] is 1, else IGNORE_INDEX."""
    targets = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    targets[:-1] = np.where(np.asarray(mask[1:]) > 0, ids[1:], IGNORE_INDEX)
    return targets


@dataclass(frozen=True)
class PackingStats:
    rows: int
    examples: int
    tokens: int  # example tokens placed in rows
    targets: int  # response predictions trained on
    seq_len: int

    @property
    def fill(self) -> float:
        """Share of the rows' slots holding example tokens (the rest is padding)."""
        return self.tokens / max(1, self.rows * self.seq_len)


class SFTRows:
    """Fixed-length rows over SFT examples: `len(rows)`, `rows.batch(indices)` -> (inputs, targets, segments),
    each (b, seq_len) int64; `rows.stats()`."""

    def __init__(self, examples, seq_len: int, packing: bool = True) -> None:
        self.examples, self.seq_len, self.packing = examples, seq_len, packing
        self.rows = pack_rows(examples.lengths, seq_len, packing)
        self._row_targets: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def row_targets(self) -> np.ndarray:
        """(rows,) response predictions per row: host-side counts for normalising a step's loss."""
        if self._row_targets is None:
            per_example = np.array([int((np.asarray(self.examples.example(i)[1][1:]) > 0).sum())
                                    for i in range(len(self.examples))], dtype=np.int64)
            self._row_targets = np.array([per_example[row].sum() for row in self.rows], dtype=np.int64)
        return self._row_targets

    def micro_batch_weights(self, step_rows: list[int], micro_batches: list[list[int]], replicas: int) -> list[float]:
        """Per micro-batch, the factor that turns its mean token loss into its share of the whole step's mean:
        count(micro-batch) / count(step) x replicas, where `step_rows` are every row of the global batch (all dp
        ranks) and `replicas` = micro-batches per rank x dp ranks, the two averages the trainer takes over the
        weighted losses. So every (dp, grad_accum, micro_batch) split of a step trains on the same loss: the mean
        over all its response tokens, however unevenly they fall into micro-batches (HF's num_items_in_batch)."""
        counts = self.row_targets()
        total = max(1, int(counts[step_rows].sum()))
        return [float(counts[mb].sum()) * replicas / total for mb in micro_batches]

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inputs = np.full(self.seq_len, PAD_ID, dtype=np.int64)
        targets = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        segments = np.zeros(self.seq_len, dtype=np.int64)
        at = 0
        for segment, i in enumerate(self.rows[index], start=1):
            ids, mask = self.examples.example(i)
            inputs[at:at + len(ids)] = ids
            targets[at:at + len(ids)] = example_targets(ids, mask)
            segments[at:at + len(ids)] = segment
            at += len(ids)
        return inputs, targets, segments

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = [self.row(i) for i in indices]
        return tuple(torch.from_numpy(np.stack([r[k] for r in rows])) for k in range(3))

    def stats(self) -> PackingStats:
        targets = sum(int((example_targets(*self.examples.example(i)) != IGNORE_INDEX).sum())
                      for row in self.rows for i in row)
        return PackingStats(len(self.rows), len(self.examples), int(np.sum(self.examples.lengths)), targets,
                            self.seq_len)
