"""qgZ (zero.quantized_gradients): the gradient reduce-scatter as a quantized all-to-all inside the node, then
across nodes (parallel/zero/qgz.py). At dp 4 = 2 nodes x 2: with the quantization bypassed it equals the flat
reduce-scatter (bit-equal on integer-valued data, 1e-12 on random fp64); int8 / int4 stay within the derived
bound sum_r M_r / Q (and come near it: the bound is the right one); the bytes per link class follow the
formula; training with qgZ keeps the masters unquantized and ends within 1% of the unquantized loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from recipe_helpers import tiny_recipe

from megazoo.parallel.collectives import CommLedger, reduce_scatter_flat
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.qgz import (QGZ_BLOCK, QGZ_LEVELS, HierarchicalReduce, decode_rows, encode_rows,
                                       error_bound, pack_int4, unpack_int4)
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

CHUNK = QGZ_BLOCK + 44  # a ragged last block in every chunk


def test_int4_packs_two_values_per_byte():
    q = torch.arange(-7, 8, dtype=torch.int8).repeat(4)[:58]
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == 29
    assert torch.equal(unpack_int4(packed), q)
    assert packed[0].item() == (-7 + 8) | ((-6 + 8) << 4)  # low nibble first


@pytest.mark.parametrize("bits", ["int8", "int4"])
@pytest.mark.parametrize("dtype, slack", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_block_round_trip_is_within_half_a_step(bits, dtype, slack):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(3, CHUNK, generator=gen, dtype=dtype)
    rows[1] *= 1e3
    rows[2, :QGZ_BLOCK] = 0
    payload, scales = encode_rows(rows, bits)
    per_row = 2 * QGZ_BLOCK // (2 if bits == "int4" else 1)  # two blocks per row, int4 packed two per byte
    assert payload.shape == (3, per_row) and scales.shape == (3, 2)
    err = (decode_rows(payload, scales, CHUNK, bits) - rows).abs()
    padded = torch.zeros(3, 2 * QGZ_BLOCK, dtype=dtype)
    padded[:, :CHUNK] = rows.abs()
    step = padded.view(3, 2, QGZ_BLOCK).amax(2, keepdim=True).expand(-1, -1, QGZ_BLOCK).reshape(3, -1)[:, :CHUNK]
    bound = step / (2 * QGZ_LEVELS[bits])
    assert (err <= bound * (1 + slack)).all()
    assert err[2, :QGZ_BLOCK].max() == 0  # an all-zero block stays exact
    assert (err / bound.clamp(min=1e-30)).max() > 0.9  # round to nearest reaches half a step somewhere


def _bucket(rank: int, integer: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4 * CHUNK, generator=gen, dtype=torch.float64) * (rank + 1)
    x[CHUNK:CHUNK + QGZ_BLOCK] *= 1e-3  # blocks of very different size
    return torch.round(x * 1000) if integer else x


def _reduce_all_ways():
    topo = Topology.build(4, node_size=2)
    rank = dist.get_rank()
    out = {}
    for integer in (True, False):
        flat = torch.empty(CHUNK, dtype=torch.float64)
        reduce_scatter_flat(flat, _bucket(rank, integer).clone(), topo.grad_group)
        out[("flat", integer)] = flat
        for bits in ("none", "int8", "int4"):
            ledger = CommLedger(node_size=2)
            reduce = HierarchicalReduce(topo.dp_intra_group, topo.dp_inter_group, 2, 2, bits, ledger)
            got = torch.empty(CHUNK, dtype=torch.float64)
            reduce.launch(got, _bucket(rank, integer).clone()).wait()
            out[(bits, integer)] = got
            out[("links", bits)] = dict(ledger.link_bytes)
    return out


@pytest.fixture(scope="module")
def reduced():
    return run_distributed(_reduce_all_ways, 4)


def test_bypassed_quantization_equals_the_flat_reduce_scatter(reduced):
    for rank in reduced:
        assert torch.equal(rank[("none", True)], rank[("flat", True)])  # integer data: any order is exact
        assert torch.allclose(rank[("none", False)], rank[("flat", False)], rtol=0, atol=1e-12)


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_quantized_reduce_is_within_the_derived_bound(reduced, bits):
    bound = error_bound([_bucket(r, False) for r in range(4)], per_node=2, bits=bits).view(4, CHUNK)
    worst = 0.0
    for r, rank in enumerate(reduced):
        err = (rank[(bits, False)] - rank[("flat", False)]).abs()
        assert (err <= bound[r] * (1 + 1e-9) + 1e-12).all()
        assert err.max() > 0  # the quantization really happened
        worst = max(worst, (err / bound[r]).max().item())
    assert worst > 0.2  # the bound is of the right size, not vacuous


def test_bytes_per_link_class_follow_the_formula(reduced):
    n, scale_bytes = 4 * CHUNK, 8 * 2  # fp64 scales, 2 blocks per chunk
    padded = 4 * 2 * QGZ_BLOCK  # the bucket's 4 chunks, each padded to 2 blocks
    # inside the node: (2-1)/2 of the whole bucket; across: (2-1)/2 of the node's partial sums (half the bucket)
    assert reduced[0][("links", "none")] == {"intra": n * 8 / 2, "inter": n / 2 * 8 / 2}
    for bits, per_element in (("int8", 1.0), ("int4", 0.5)):
        intra = (padded * per_element + 4 * scale_bytes) / 2
        assert reduced[0][("links", bits)] == {"intra": intra, "inter": intra / 2}


@pytest.mark.parametrize("zero, message", [
    ({"stage": 0, "quantized_gradients": "int8"}, r"zero.quantized_gradients = 'int8' needs zero.stage 1, 2 or 3 "
                                                  r"\(got 0\)"),
    ({"stage": 2, "quantized_gradients": "int2"}, r"zero.quantized_gradients = 'int2' is invalid; valid: 'none', "
                                                  r"'int8', 'int4'"),
    ({"stage": 2, "quantized_gradients": "int4", "shard_group": "node"},
     r"needs zero.shard_group = 'dp' \(got 'node'\)"),
    ({"stage": 2, "quantized_gradients": "int4", "offload": "cpu"},
     r"zero.quantized_gradients = 'int4' with zero.offload = 'cpu' is not supported; valid: zero.offload = 'none'"),
])
def test_invalid_combinations_are_refused_before_any_process_starts(zero, message):
    with pytest.raises(RecipeError, match=message):
        resolve(tiny_recipe(parallel={"dp": 4, "node_size": 2}, zero=zero))


def test_qgz_with_cp_or_a_compressed_optimizer_is_refused():
    with pytest.raises(RecipeError, match=r"zero.quantized_gradients = 'int8' needs parallel.cp = 1 \(got 2\)"):
        resolve(tiny_recipe(parallel={"dp": 2, "cp": 2}, zero={"stage": 2, "quantized_gradients": "int8"}))
    with pytest.raises(RecipeError, match=r"with optimizer.name = 'onebit_adam' is not supported"):
        resolve(tiny_recipe(parallel={"dp": 2}, zero={"stage": 1, "quantized_gradients": "int8"},
                            optimizer={"name": "onebit_adam"}))


def _train_layouts():
    topo = Topology.build(4, node_size=2)
    out = {}
    for name, zero, bypass in [("flat-1", {"stage": 1}, False), ("qgz-1", {"stage": 1}, True),
                               ("flat-2", {"stage": 2}, False), ("qgz-2", {"stage": 2}, True),
                               ("int8-2", {"stage": 2}, False), ("qgz-hpz-3", {"stage": 3, "hpz": True}, True)]:
        quantized = "int8" if name.startswith(("qgz", "int8")) else "none"
        res = resolve(tiny_recipe(parallel={"dp": 4, "node_size": 2}, zero={**zero, "quantized_gradients": quantized},
                                  train={"steps": 2, "micro_batch": 1, "grad_accum": 2}))
        trainer = Trainer(res, topo)
        if bypass:  # the same hierarchical all-to-alls, unquantized values on the wire
            trainer.zero.reducer.hierarchical.bits = "none"
        out[name] = {"losses": trainer.fit().losses, "params": trainer.full_state_dict(),
                     "hierarchical": trainer.zero.reducer.hierarchical is not None,
                     "kinds": sorted(trainer.zero.comm.bytes)}
    return out


def test_training_with_the_bypassed_hierarchical_reduce_equals_flat_zero():
    got = run_distributed(_train_layouts, 4)[0]
    for name, ref in (("qgz-1", "flat-1"), ("qgz-2", "flat-2")):
        assert got[name]["hierarchical"] and not got[ref]["hierarchical"]
        assert "all_to_all" in got[name]["kinds"] and "reduce_scatter" not in got[name]["kinds"]
        for a, b in zip(got[name]["losses"], got[ref]["losses"]):
            assert abs(a - b) < 1e-10
        for key, value in got[ref]["params"].items():
            assert torch.allclose(got[name]["params"][key], value, rtol=0, atol=1e-10), key
    for a, b in zip(got["qgz-hpz-3"]["losses"], got["flat-1"]["losses"]):  # ZeRO-3 + hpZ: the same function
        assert abs(a - b) < 1e-10
    assert "all_to_all_int8" in got["int8-2"]["kinds"]
    diffs = [abs(a - b) / b for a, b in zip(got["int8-2"]["losses"][1:], got["flat-2"]["losses"][1:])]
    assert 0 < max(diffs) < 1e-3  # quantized gradients: close, not equal (the first loss precedes any update)
