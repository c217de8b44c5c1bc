"""How the ZeRO stages hold and move gradients (issue 13): structure, not speed (no wall-clock thresholds).

- stage 0 is DDP's reducer: gradients are views into flat buckets and a bucket's all-reduce is launched from the
  gradient hooks while backward still runs (not after it), with the same result as an all-reduce after backward;
- stages 1-3 in fp32/fp64: the owned parameter chunk is its own optimizer master (aliased storage, no copy);
- stages 2-3: the full-size gradient buckets come from one pool that reuses buffers within a backward and holds
  nothing between steps.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from zero_helpers import LR, TOL, batches, lm_loss, tiny_gpt2

from megazoo.parallel.data_parallel import GradientAllReducer, all_reduce_gradients
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.api import ZeroEngine


def _stage0_overlap():
    torch.set_num_threads(1)
    topo = Topology.build(dp=2)
    model = tiny_gpt2()
    engine = ZeroEngine(model, topo, stage=0, lr=LR, bucket_elements=20_000)
    reducer = engine.zero.reducer
    launched_during_backward = []
    # The first block's parameters are among the last gradients backward produces: by then earlier buckets
    # (the head side) must already be in flight.
    first = next(model.transformer.h[0].parameters())
    first.register_post_accumulate_grad_hook(lambda p: launched_during_backward.append(len(reducer._works)))
    batch = batches()[topo.dp_rank, :4]  # different data per rank
    loss = lm_loss(model(input_ids=batch).logits, batch)
    engine.backward(loss)
    views = all(any(p.grad.data_ptr() >= f.data_ptr() and p.grad.data_ptr() < f.data_ptr() + f.nbytes
                    for f in reducer.flats) for p in model.parameters())
    engine.zero.finish_gradients()
    # The same average, the synchronous way (cat, all-reduce, copy back), on an untouched copy of the model.
    plain = tiny_gpt2()
    lm_loss(plain(input_ids=batch).logits, batch).backward()
    all_reduce_gradients(list(plain.parameters()), topo.dp_group)
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), plain.parameters()))
    return len(reducer.flats), launched_during_backward, views, diff


def test_stage0_gradients_are_bucket_views_reduced_during_backward():
    for n_buckets, launched, views, diff in run_distributed(_stage0_overlap, 2):
        assert n_buckets > 2 and views
        assert launched and launched[0] >= 1  # some bucket's all-reduce was in flight before backward ended
        assert diff <= TOL


def test_stage0_gradients_survive_set_to_none():
    """A loop that sets .grad to None (model.zero_grad()) still trains into the buckets."""
    model = tiny_gpt2()
    reducer = GradientAllReducer(list(model.parameters()), None, 20_000)
    model.zero_grad(set_to_none=True)
    batch = batches()[0, :2]
    lm_loss(model(input_ids=batch).logits, batch).backward()
    total = sum(p.grad.abs().sum() for p in model.parameters())
    assert sum(f.abs().sum() for f in reducer.flats) == pytest.approx(total.item(), rel=1e-12)
    reducer.zero_()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def _aliasing(stage: int, dtype: torch.dtype):
    torch.set_num_threads(1)
    model = tiny_gpt2().to(dtype)
    engine = ZeroEngine(model, Topology.build(dp=2), stage=stage, lr=LR, bucket_elements=20_000)
    zero = engine.zero
    owned = [u_shard for u_shard in zero.shards]
    aliased = [m.data_ptr() == s.data_ptr() for m, s in zip(zero.masters, owned)]
    pool_peak = 0
    for step in range(2):
        batch = batches()[step, :4]
        engine.backward(lm_loss(model(input_ids=batch).logits.to(torch.float64), batch))
        pool_peak = max(pool_peak, zero.reducer.pool.nbytes())
        engine.step()
    n = sum(p.numel() for p in model.parameters())
    return aliased, zero.memory_bytes(), n, zero.reducer.pool.nbytes(), pool_peak


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_masters_alias_the_owned_chunks(stage):
    for aliased, mem, n, pool_after, _ in run_distributed(_aliasing, 2, stage, torch.float64):
        assert all(aliased)
        assert mem["optimizer"] <= 2 * 8 * (n / 2 + 64 * 20)  # fp64 moments of half the model, no master
        assert pool_after == 0  # nothing transient held between steps


def test_fp16_keeps_separate_fp32_masters():
    for aliased, *_ in run_distributed(_aliasing, 2, 2, torch.float16):
        assert not any(aliased)


def _prefetch(stage: int):
    """Stages 1-2: after a step the all-gathers are still in flight; the next forward's module hooks wait for
    them, and training equals the same stage with the gathers waited inside the step."""
    torch.set_num_threads(1)
    results = []
    for prefetch in (True, False):
        model = tiny_gpt2()
        engine = ZeroEngine(model, Topology.build(dp=2), stage=stage, lr=LR, bucket_elements=20_000)
        engine.zero._prefetch = prefetch
        in_flight, losses = [], []
        for step in range(3):
            batch = batches()[step, :4]
            loss = lm_loss(model(input_ids=batch).logits, batch)
            engine.backward(loss)
            engine.step()
            in_flight.append(len(engine.zero._gathers))
            losses.append(loss.item())
        state = {k: v.clone() for k, v in engine.full_state_dict().items()}
        results.append((in_flight, losses, state))
    return results


@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_all_gathers_overlap_the_next_forward(stage):
    for (in_flight, losses, state), (waited, ref_losses, ref_state) in run_distributed(_prefetch, 2, stage):
        assert all(n > 1 for n in in_flight) and not any(waited)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
        assert max((state[k] - ref_state[k]).abs().max().item() for k in state) <= TOL
