"""qwZ (zero.quantized_weights): stage 3's parameter gathers in int8 blocks of QWZ_BLOCK elements. Each
element's error is at most max|block| / 254 (round to nearest on a grid of max|block| / 127), the owned masters
are never quantized, full-weight reads stay exact, and training follows the unquantized run closely."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.quantized import QWZ_BLOCK, dequantize_blocks, quantize_blocks, quantized_all_gather
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer


def _bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element: max|its block| / 254, the bound round-to-nearest on the block's int8 grid gives."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=x.dtype)
    padded[:n] = x
    return (padded.view(-1, block).abs().amax(dim=1, keepdim=True) / 254).expand(-1, block).reshape(-1)[:n]


@pytest.mark.parametrize("dtype, slack", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_quantization_error_per_block_is_bounded(dtype, slack):
    gen = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes, an all-zero block and a ragged end (not a multiple of the block)
    x = torch.randn(5 * QWZ_BLOCK + 37, generator=gen, dtype=dtype)
    x[:QWZ_BLOCK] *= 1e-4
    x[QWZ_BLOCK:2 * QWZ_BLOCK] = 0
    x[2 * QWZ_BLOCK:3 * QWZ_BLOCK] *= 1e3
    q, scale = quantize_blocks(x)
    assert q.dtype == torch.int8 and q.numel() == 6 * QWZ_BLOCK and scale.numel() == 6
    err = (dequantize_blocks(q, scale)[:x.numel()] - x).abs()
    bound = _bound(x, QWZ_BLOCK)
    assert (err <= bound * (1 + slack) + torch.finfo(dtype).tiny).all()
    assert err[QWZ_BLOCK:2 * QWZ_BLOCK].max() == 0  # zeros stay exact
    assert (err / bound.clamp(min=1e-30)).max() > 0.4  # the bound is approached: it is the right one


def _gather(block_numel: int):
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(block_numel, generator=gen) * (rank + 1)
    out = torch.empty(2 * block_numel)
    ledger = CommLedger()
    quantized_all_gather(out, shard, torch.distributed.group.WORLD, 2, ledger=ledger).wait()
    return shard, out, dict(ledger.bytes)


def test_quantized_gather_sends_int8_and_every_rank_gets_the_dequantized_chunks():
    n = 3 * QWZ_BLOCK + 5
    (s0, out0, sent), (s1, out1, _) = run_distributed(_gather, 2, n)
    assert torch.equal(out0, out1)
    for i, shard in enumerate((s0, s1)):
        q, scale = quantize_blocks(shard)
        assert torch.equal(out0[i * n:(i + 1) * n], dequantize_blocks(q, scale)[:n])
        assert ((out0[i * n:(i + 1) * n] - shard).abs() <= _bound(shard, QWZ_BLOCK) * (1 + 1e-6)).all()
    # per rank: (N-1)/N of 4 padded blocks of int8 + 4 fp32 scales, against 4 bytes x n unquantized
    assert sent == {"all_gather_int8": 4 * QWZ_BLOCK, "all_gather_scales": 4 * 4}


def test_quantized_weights_need_stage_3():
    with pytest.raises(RecipeError, match=r"zero.quantized_weights = true needs zero.stage = 3 \(got 2\)"):
        resolve(tiny_recipe(parallel={"dp": 2}, zero={"stage": 2, "quantized_weights": True}))


def test_qwz_trains_close_to_exact_with_exact_masters():
    exact = tiny_resolved(parallel={"dp": 2}, zero={"stage": 3}, train={"steps": 3})
    quant = tiny_resolved(parallel={"dp": 2}, zero={"stage": 3, "quantized_weights": True}, train={"steps": 3})

    def work():
        topo = Topology.build(2)
        a, b = Trainer(exact, topo), Trainer(quant, topo)
        shards = [s.clone() for s in b.zero.shards]
        val_a, val_b = a.evaluate(), b.evaluate()  # forward with gathered weights: exact vs int8 blocks
        untouched = all(torch.equal(s, t) for s, t in zip(shards, b.zero.shards))
        full_b = b.full_state_dict()
        same_full = all(torch.equal(v, full_b[k]) for k, v in a.full_state_dict().items())
        return {"val": (val_a, val_b), "untouched": untouched, "same_full": same_full,
                "losses": (a.fit().losses, b.fit().losses), "masters": {m.dtype for m in b.zero.masters}}

    for got in run_distributed(work, 2):
        assert got["untouched"] and got["same_full"]  # masters never quantized; gathered() reads them exactly
        assert got["masters"] == {torch.float64}
        val_a, val_b = got["val"]
        assert 0 < abs(val_a - val_b) < 1e-3 * val_a  # the forward did run on quantized weights
        for la, lb in zip(*got["losses"]):
            assert abs(la - lb) < 1e-2 * la
