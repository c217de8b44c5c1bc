"""GlobalBatchSampler: the same global batches for every (dp, micro batch, grad accum) split."""

import pytest

from megazoo.data.batches import GlobalBatchSampler


def flat_global_batch(step: int, num_samples: int, micro: int, accum: int, dp: int, seed: int = 0) -> list[int]:
    """Indices of one step over all dp ranks, in rank then micro-batch order."""
    flat = []
    for rank in range(dp):
        sampler = GlobalBatchSampler(num_samples, micro * accum * dp, micro, accum, rank, dp, seed)
        for micro_batch in sampler.indices_for_step(step):
            assert len(micro_batch) == micro
            flat.extend(micro_batch)
    return flat


def test_ranks_are_disjoint_and_cover_the_global_batch():
    for step in range(5):
        per_rank = [
            sum(GlobalBatchSampler(100, 12, 2, 3, rank, 2, seed=0).indices_for_step(step), []) for rank in range(2)
        ]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert per_rank[0] + per_rank[1] == flat_global_batch(step, 100, micro=12, accum=1, dp=1)


def test_dp_split_and_grad_accum_see_the_same_samples():
    for step in range(20):  # 100 // 8 = 12 steps per epoch: crosses an epoch boundary
        reference = flat_global_batch(step, 100, micro=8, accum=1, dp=1)
        assert flat_global_batch(step, 100, micro=4, accum=1, dp=2) == reference
        assert flat_global_batch(step, 100, micro=4, accum=2, dp=1) == reference
        assert flat_global_batch(step, 100, micro=2, accum=2, dp=2) == reference
        assert flat_global_batch(step, 100, micro=1, accum=2, dp=4) == reference


def test_deterministic_per_seed():
    steps = range(30)
    a = [flat_global_batch(s, 50, 2, 2, 2, seed=7) for s in steps]
    assert a == [flat_global_batch(s, 50, 2, 2, 2, seed=7) for s in steps]
    assert a != [flat_global_batch(s, 50, 2, 2, 2, seed=8) for s in steps]


def test_each_epoch_uses_every_sample_at_most_once():
    num_samples, global_batch = 64, 8  # divides: every sample exactly once per epoch
    for epoch in range(3):
        seen = sum((flat_global_batch(epoch * 8 + k, num_samples, 4, 1, 2) for k in range(8)), [])
        assert sorted(seen) == list(range(num_samples))
    # 70 samples: 8 steps per epoch, each epoch drops a different tail of 6 samples.
    epochs = [sum((flat_global_batch(e * 8 + k, 70, 4, 1, 2) for k in range(8)), []) for e in range(2)]
    assert all(len(set(seen)) == 64 for seen in epochs)
    assert set(epochs[0]) != set(epochs[1])


def test_unshuffled_order_is_identity():
    sampler = GlobalBatchSampler(10, 4, 2, 1, dp_rank=1, dp_size=2, seed=0, shuffle=False)
    assert sampler.indices_for_step(0) == [[2, 3]]
    assert sampler.indices_for_step(1) == [[6, 7]]
    assert sampler.indices_for_step(2) == [[2, 3]]  # epoch 1 starts over; samples 8, 9 are the dropped tail


def test_resume_is_stateless():
    fresh = GlobalBatchSampler(100, 8, 2, 2, 1, 2, seed=3)
    used = GlobalBatchSampler(100, 8, 2, 2, 1, 2, seed=3)
    for step in range(40):
        used.indices_for_step(step)
    assert used.indices_for_step(17) == fresh.indices_for_step(17)


def test_bad_arithmetic_names_the_values():
    with pytest.raises(ValueError, match=r"global_batch=10 .* = 2 x 2 x 2 = 8"):
        GlobalBatchSampler(100, 10, micro_batch=2, grad_accum=2, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match=r"num_samples=4 .*global_batch=8"):
        GlobalBatchSampler(4, 8, 2, 2, 0, 2, seed=0)
    with pytest.raises(ValueError, match=r"dp_rank=2"):
        GlobalBatchSampler(100, 8, 2, 2, 2, 2, seed=0)
    with pytest.raises(ValueError, match=r"step"):
        GlobalBatchSampler(100, 8, 2, 2, 0, 2, seed=0).indices_for_step(-1)
