"""ZeRO-3 on the CPU keeps a freed unit's memory for the next gather of its size (parallel/zero/gather/spare.py):
the parameters' storages change memory, never identity, so views and autograd's saved references stay valid;
a gather of another size releases what is parked first; nothing is parked between steps; and training is
unchanged (fp64, 1e-10 against the same run with the cache disabled)."""

from __future__ import annotations

import torch
from harness import run_distributed

from megazoo.models.config import ModelConfig
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.api import ZeroEngine
from megazoo.parallel.zero.gather.spare import SpareStorages

CFG = ModelConfig("gpt-4x32", n_layer=4, d_model=32, n_head=4, vocab_size=256, n_positions=16,
                  dropout=0.0, attn_dropout=0.0)


def test_parked_memory_moves_under_the_same_views():
    spare = SpareStorages(limit=64)
    a = torch.arange(8, dtype=torch.float64)
    view, storage = a[2:5], a.untyped_storage()
    address = storage.data_ptr()
    spare.free(storage)
    assert storage.nbytes() == 0 and spare.nbytes() == 64
    b = torch.empty(8, dtype=torch.float64)
    b.untyped_storage().resize_(0)
    spare.fill(b.untyped_storage(), 64)  # same size: the parked memory itself, no allocation
    assert (spare.hits, spare.misses, spare.nbytes()) == (1, 0, 0)
    assert b.untyped_storage().data_ptr() == address
    spare.fill(storage, 64)  # nothing parked: allocates
    a.copy_(torch.arange(10, 18, dtype=torch.float64))
    assert view.tolist() == [12.0, 13.0, 14.0]  # the old view reads the storage's new memory
    assert spare.misses == 1


def test_a_miss_releases_what_is_parked_and_the_limit_holds():
    spare = SpareStorages(limit=100)
    x, y = torch.empty(10), torch.empty(20)  # 40 and 80 bytes
    spare.free(x.untyped_storage())
    spare.free(y.untyped_storage())  # 40 + 80 > 100: released, not parked
    assert spare.nbytes() == 40 and y.untyped_storage().nbytes() == 0
    spare.fill(y.untyped_storage(), 80)  # no 80-byte storage parked: the 40 bytes go first
    assert spare.nbytes() == 0 and y.untyped_storage().nbytes() == 80


def _train(use_spare: bool):
    torch.set_num_threads(1)
    topo = Topology.build(dp=2)
    model = GPT(CFG, topo)
    init_weights(model, 0)
    model.double()
    engine = ZeroEngine(model, topo, stage=3, lr=1e-2, weight_decay=0.1)
    zero = engine.zero
    if not use_spare:
        zero.spare.limit = 0
    gen = torch.Generator().manual_seed(10 + topo.dp_rank)
    losses, parked_after_backward = [], []
    for _ in range(3):
        ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=gen)
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        engine.backward(loss)
        engine.step()
        parked_after_backward.append(zero.spare.nbytes())
        losses.append(loss.item())
    with zero.gathered():
        params = [p.detach().clone() for p in model.parameters()]
    return losses, params, zero.spare.hits, zero.spare.misses, parked_after_backward


def test_zero3_reuses_freed_units_and_trains_the_same():
    (with_, without) = (run_distributed(_train, 2, use) for use in (True, False))
    for (l1, p1, hits, misses, parked), (l2, p2, hits0, _, _) in zip(with_, without):
        assert hits0 == 0
        # Fills per step (a block is 2 buckets, the root 3): forward misses the root and blocks 0-1 (7 fills,
        # nothing is parked yet) and hits blocks 2-3 (4); backward hits block 3 (its own memory, parked after its
        # forward), misses block 2 (the root's freed memory is another size) and hits blocks 1-0 (6 fills in
        # all). gathered() at the end: 11 misses (everything was released after the last backward).
        assert (hits, misses) == (3 * 10, 3 * 9 + 11)
        assert parked == [0, 0, 0]  # released at the end of every backward
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-10
        assert max((a - b).abs().max().item() for a, b in zip(p1, p2)) < 1e-10
