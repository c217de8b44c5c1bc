"""ZeRO-3's transient memory: what is held between the forward and the blocks' backward, and at the root's
reduction (parallel/zero/stage3.py, buckets.py).

- The owned gradient chunks do not exist while a step's forward runs: released when its first micro-batch
  starts, created by their first reduce-scatter (as FSDP's sharded gradients); between steps they are zero.
- The root unit (embeddings, final LayerNorm) is freed when backward reaches the blocks: its readers (the tied
  head) are done, and the embedding lookup's backward needs only the token ids.
- A root parameter read between blocks keeps the root gathered through backward (its backward needs the
  values), and training still equals a single-process fp64 reference to 1e-10.
- The tied embedding sits alone in its bucket: its autograd gradient is reduce-scattered as it is; no
  full-size pool buffer of its size is ever allocated.
- At most one unit's full-size gradient buffers are held at once: a unit's first gradient first finishes the
  previous unit's reduce-scatter, whose buffer it then reuses (one block-size buffer allocated per step); that reduce-scatter's output becomes the owned
  gradient (no copy) when the owned gradient does not exist yet.
- The buffer pool lets go of free buffers too small for a request before allocating a larger one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from harness import run_distributed

from megazoo.models.config import ModelConfig
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.api import ZeroEngine
from megazoo.parallel.zero.buckets import BufferPool

TOL = 1e-10
CFG = ModelConfig("gpt-3x32", n_layer=3, d_model=32, n_head=4, vocab_size=512, n_positions=16,
                  dropout=0.0, attn_dropout=0.0)


def _gathered_bytes(unit) -> int:
    return sum(b.flat_params.untyped_storage().nbytes() for b in unit.buckets)


def _root_during_backward():
    """Root unit bytes gathered right after forward and at each block's backward; pool requests (numel)."""
    torch.set_num_threads(1)
    topo = Topology.build(dp=2)
    model = GPT(CFG, topo)
    init_weights(model, 0)
    model.double()
    engine = ZeroEngine(model, topo, stage=3, lr=1e-3)
    zero = engine.zero
    at_blocks, after_forward, taken, grads_in_forward, after_step = [], [], [], [], []
    for block in model.h.values():  # registered after the engine's hooks: runs after its pre-backward
        block.register_full_backward_pre_hook(
            lambda m, g: at_blocks.append(_gathered_bytes(zero.root) + len(zero.reducer._pending)))
    pool_bytes, kept = [], []
    for p in model.parameters():  # registered after the engine's: sees the buffer it took for this gradient
        p.register_post_accumulate_grad_hook(lambda p: pool_bytes.append(zero.reducer.pool.nbytes()))
    release = zero.reducer.pool.release
    zero.reducer.pool.release = lambda view: kept.append(release(view)) or kept[-1]
    take = zero.reducer.pool.take
    zero.reducer.pool.take = lambda numel, *a: taken.append(numel) or take(numel, *a)
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(topo.dp_rank))
    allocated = []  # per step: full-size buffers the pool allocated for a block's weight-matrix bucket
    for _ in range(3):
        before = zero.reducer.pool.allocated.copy()
        logits = model(ids[:, :-1])
        after_forward.append(_gathered_bytes(zero.root))
        grads_in_forward.append((zero.gradients(), zero.memory_bytes()["grads"]))
        engine.backward(model.loss(logits, ids[:, 1:]))
        engine.step()
        after_step.append([g.abs().max().item() for g in zero.owned_grads])
        allocated.append((zero.reducer.pool.allocated - before)[max(b.numel for b in zero.blocks[0].buckets)])
    alone = [b.numel for b in zero.root.buckets if b.names == ["wte.weight"]]
    unit_bytes = max(sum(b.numel * 8 for b in u.buckets) for u in zero.blocks)
    return (at_blocks, after_forward, taken, alone, _gathered_bytes(zero.root), grads_in_forward, after_step,
            (max(pool_bytes), unit_bytes, kept), allocated)


def test_root_unit_is_freed_when_backward_reaches_the_blocks():
    for at_blocks, after_forward, taken, alone, root_after, in_forward, after_step, pool, allocated in \
            run_distributed(_root_during_backward, 2):
        assert all(b > 0 for b in after_forward)  # the head reads the tied embedding: gathered for forward
        assert len(at_blocks) == 3 * CFG.n_layer and all(b == 0 for b in at_blocks)  # + no reduction pending
        assert root_after == 0
        assert in_forward == [([], 0)] * 3  # no owned gradient while the forward runs
        # The blocks' weight-matrix gradient buffer: allocated once per step (the pool lets go of everything at
        # the root's reduction), then reused by every block. A unit takes its buffers largest first: taken in
        # gradient order, the biases' small bucket missed and its miss released the block-size buffer, so each
        # block allocated (and page-faulted) one: CFG.n_layer per step.
        assert allocated == [1, 1, 1]
        assert all(g and max(g) == 0 for g in after_step)  # between steps: every owned gradient exists, zero
        pool_peak, unit_bytes, kept = pool
        assert pool_peak <= 1.5 * unit_bytes  # one block's buffers (+ a reduce-scatter output), never two blocks'
        assert sum(kept) >= 2 * CFG.n_layer  # each block's (2 buckets) reduced chunk became its owned gradient
        # wte alone in a bucket (vocab 512 x 32 is divisible by dp): reduced from autograd's gradient, so the
        # pool never hands out a full-size buffer for it (only its 1/dp reduce-scatter output).
        assert len(alone) == 1 and alone[0] == CFG.vocab_size * CFG.d_model
        assert alone[0] not in taken and alone[0] // 2 in taken


class GatedStack(nn.Module):
    """Embedding, two blocks with a root parameter read BETWEEN them (x * gate), untied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        x = self.blocks[0](self.emb(ids))
        return self.head(self.blocks[1](x * self.gate))


def _gated_model() -> GatedStack:
    torch.manual_seed(0)
    return GatedStack().double()


def _data() -> torch.Tensor:
    return torch.randint(0, 64, (3, 4, 9), generator=torch.Generator().manual_seed(3))


def _loss(model, ids):
    return nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _gated_zero3():
    torch.set_num_threads(1)
    topo = Topology.build(dp=2)
    model = _gated_model()
    engine = ZeroEngine(model, topo, stage=3, lr=1e-2, weight_decay=0.1)
    root_at_blocks, losses = [], []
    for block in model.blocks:
        block.register_full_backward_pre_hook(lambda m, g: root_at_blocks.append(_gathered_bytes(engine.zero.root)))
    for batch in _data():
        mine = batch[2 * topo.dp_rank:2 * topo.dp_rank + 2]
        loss = _loss(model, mine)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return root_at_blocks, losses, engine.full_state_dict()


def test_root_read_between_blocks_stays_gathered_and_trains_exactly():
    model = _gated_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-2)
    ref_losses = []
    for batch in _data():
        halves = [_loss(model, batch[:2]), _loss(model, batch[2:])]
        ((halves[0] + halves[1]) / 2).backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(torch.stack(halves))
    for rank, (root_at_blocks, losses, state) in enumerate(run_distributed(_gated_zero3, 2)):
        assert len(root_at_blocks) == 2 * 3 and all(b > 0 for b in root_at_blocks)
        for got, want in zip(losses, ref_losses):
            assert abs(got.item() - want[rank].item()) < TOL
        for name, p in model.state_dict().items():
            assert (state[name] - p).abs().max().item() < TOL, name


def test_pool_releases_smaller_free_buffers_on_a_miss():
    pool = BufferPool()
    small = [pool.take(100, torch.float32, torch.device("cpu")) for _ in range(2)]
    for view in small:
        pool.give(view)
    assert pool.nbytes() == 2 * 100 * 4
    again = pool.take(80, torch.float32, torch.device("cpu"))  # a hit: reuses the smallest that fits
    assert pool.nbytes() == 2 * 100 * 4
    pool.give(again)
    pool.take(1000, torch.float32, torch.device("cpu"))  # a miss: the two 100s are released first
    assert pool.nbytes() == 1000 * 4
