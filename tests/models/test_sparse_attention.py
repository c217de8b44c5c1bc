"""Block-sparse attention (models/sparse_attention.py): the patterns' block layouts, the gathered implementation
and FlexAttention equal dense attention under the same mask, and a sparse GPT trains the same function under
context parallelism (all-to-all runs the sparse kernel on whole sequences) as in one process."""

from __future__ import annotations

import pytest
import parity_helpers as parity
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.kernels.attention import attention_reference
from megazoo.models import sparse_attention
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.sparse_attention import (SparseAttention, block_layout, block_sparse_attention,
                                             flex_sparse_attention, masked_dense_attention, token_mask)
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve

TOL = 1e-10
PATTERNS = [("fixed", 4, 1, 0), ("bigbird", 3, 1, 2), ("sliding_window", 3, 0, 0)]


def test_layouts():
    assert block_layout("sliding_window", 4, 2).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0],
                                                                    [0, 0, 1, 1]]
    # Windows of 2 blocks; the last block of each window (1, 3) is a summary every later block sees.
    assert block_layout("fixed", 6, 2, 1).int().tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0],
        [0, 1, 0, 1, 1, 1]]
    big = block_layout("bigbird", 32, 3, 1, 2, seed=5)
    assert torch.equal(big, block_layout("bigbird", 32, 3, 1, 2, seed=5))  # the seed fixes the random blocks
    base = block_layout("bigbird", 32, 3, 1, 0)
    assert torch.equal(big & base, base) and (big & ~base).sum(1).max() <= 2 and (big & ~base).sum() > 0
    for pattern, local, glob, rand in PATTERNS:
        lay = block_layout(pattern, 16, local, glob, rand)
        assert torch.equal(lay, lay.tril()) and lay.diagonal().all()  # causal; every block sees itself
        assert lay.sum() < 16 * 17 // 2  # actually sparse
    with pytest.raises(ValueError, match="model.sparse_pattern = 'star' is invalid"):
        block_layout("star", 4, 2)


def _qkv(s, heads=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, s, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _forward_backward(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    y = fn(q, k, v)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
    return [y.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("pattern, local, glob, rand", PATTERNS)
@pytest.mark.parametrize("s", [128, 120])  # 120: not whole blocks, padded inside
def test_block_sparse_equals_masked_dense(pattern, local, glob, rand, s, monkeypatch):
    monkeypatch.setattr(sparse_attention, "CHUNK_ROWS", 24)  # chunks of 3 query blocks, the last one partial
    block = 8
    layout = block_layout(pattern, -(-s // block), local, glob, rand)
    q, k, v = _qkv(s)
    got = _forward_backward(lambda *t: block_sparse_attention(*t, layout, block), q, k, v)
    want = _forward_backward(lambda *t: masked_dense_attention(*t, layout, block), q, k, v)
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=f"{pattern} s={s} {name}")
    # and the pattern matters: it is not dense causal attention
    assert (got[0] - attention_reference(q, k, v).detach()).abs().max() > 1e-3


def test_full_pattern_is_dense_causal_attention():
    q, k, v = _qkv(64)
    layout = block_layout("sliding_window", 8, 8)  # a window over every block: nothing is left out
    got = _forward_backward(lambda *t: block_sparse_attention(*t, layout, 8), q, k, v)
    want = _forward_backward(attention_reference, q, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("pattern, local, glob, rand", PATTERNS)
def test_flex_attention_forward_equals_masked_dense(pattern, local, glob, rand):
    """FlexAttention with the BlockMask of the same layout (eager on CPU: forward only, torch 2.13)."""
    block, s = 16, 128
    layout = block_layout(pattern, s // block, local, glob, rand)
    q, k, v = (t.detach() for t in _qkv(s))
    torch.testing.assert_close(flex_sparse_attention(q, k, v, layout, block),
                               masked_dense_attention(q, k, v, layout, block), rtol=0, atol=TOL)


def test_sparse_attention_from_config():
    cfg = get_preset("gpt2-tiny").replace(attention="sparse", sparse_pattern="sliding_window", sparse_block=16,
                                          sparse_local_blocks=2)
    fn = SparseAttention.from_config(cfg, torch.device("cpu"))
    assert fn.implementation == "gather"
    assert fn.density(256) == pytest.approx(token_mask(fn.layout(256), 16, 256).sum().item() / (256 * 257 / 2))
    assert fn.density(1024) < fn.density(256) < 1  # fixed work per token: the kept share falls as s grows
    q, k, v = _qkv(96)
    dense = SparseAttention("sliding_window", 16, 2, 0, 0, 0, implementation="dense")
    torch.testing.assert_close(fn(q, k, v), dense(q, k, v), rtol=0, atol=TOL)


SPARSE = {"attention": "sparse", "sparse_pattern": "bigbird", "sparse_block": 4, "sparse_local_blocks": 2,
          "sparse_global_blocks": 1, "sparse_random_blocks": 1}


def test_sparse_model_trains_the_same_under_context_parallelism():
    solo = tiny_resolved(train={"micro_batch": 8, "steps": 4}, model=SPARSE)
    model = GPT(solo.model, Topology.solo(), device="meta")
    assert all(isinstance(block.attn.attend, SparseAttention) for block in model.h.values())
    ref = parity.train_run(solo, Topology.solo())
    assert ref["losses"][-1] < ref["losses"][0]
    res = tiny_resolved(parallel={"cp": 2, "cp_attention": "all_to_all"}, train={"micro_batch": 8, "steps": 4},
                        model=SPARSE)

    def work():
        return parity.train_run(res, Topology.build(1, cp=2, cp_attention="all_to_all"))

    for got in run_distributed(work, 2):
        parity.assert_same_training(got, ref)


@pytest.mark.parametrize("model, parallel, message", [
    ({"attention": "blocky"}, {}, "model.attention = 'blocky' is invalid; valid: 'dense', 'sparse'"),
    ({"sparse_pattern": "star"}, {}, "model.sparse_pattern = 'star' is invalid"),
    ({"sparse_block": 0}, {}, "model.sparse_block = 0 is invalid"),
    ({"sparse_local_blocks": 2, "sparse_global_blocks": 3}, {}, "model.sparse_global_blocks = 3 is larger"),
    (SPARSE, {"cp": 2, "cp_attention": "ring"}, "parallel.cp_attention = \"ring\" computes dense causal attention"),
])
def test_bad_sparse_recipes_fail_before_start(model, parallel, message):
    with pytest.raises(RecipeError) as err:
        resolve(tiny_recipe(model=model, parallel=parallel))
    assert message in str(err.value)
