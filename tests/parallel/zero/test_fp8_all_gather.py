"""ZeRO-3's FP8 all-gather (zero.fp8_all_gather; parallel/zero/gather/fp8.py), numerics emulated on the CPU.

- The FP8 linears' weights arrive as float8 e4m3 values times one scale per weight (really quantized: the
  gathered weight differs from the master, and W x s is an e4m3 number), within e4m3's stated error of the
  master (relative 2^-4, plus half the smallest subnormal / s); every other parameter arrives exact.
- FP8 training with it equals FP8 training with a full-precision gather (the FP8 linear re-quantizes the gathered
  weight to the same e4m3 values; only the scale's fp32 rounding differs), fp64, 3 steps of dp 2.
- The ledger counts 1 byte per gathered element of those weights (a quarter of fp32's 4, half of bf16's 2), forward
  and backward, and the full dtype for the rest; masters and exported weights stay exact.
- Refused with a message: stage 2, the rowwise recipe, qwZ.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from megazoo.models.config import ModelConfig
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.tensor.fp8 import E4M3, enable_fp8
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.api import ZeroEngine
from megazoo.parallel.zero.gather.fp8 import fp8_weight_names

CFG = ModelConfig("gpt-2x32", n_layer=2, d_model=32, n_head=2, vocab_size=256, n_positions=16,
                  dropout=0.0, attn_dropout=0.0)
U = 2.0 ** -4  # e4m3's unit roundoff (3 mantissa bits)
SUBNORMAL = 2.0 ** -9  # e4m3's smallest subnormal


def _model(topo, recipe="tensorwise"):
    model = GPT(CFG, topo)
    init_weights(model, 0)
    model.double()
    enable_fp8(model, recipe)
    return model


def _train(fp8_gather: bool):
    torch.set_num_threads(1)
    topo = Topology.build(dp=2)
    model = _model(topo)
    engine = ZeroEngine(model, topo, stage=3, lr=1e-2, weight_decay=0.1, fp8_all_gather=fp8_gather)
    names = fp8_weight_names(model)
    params = dict(model.named_parameters())
    seen = {}  # the first forward's gathered weights, checked against the masters below

    def look(module, args):
        if not seen:
            seen.update({n: params[n].detach().clone() for n in params if n.startswith("h.0.")})
    model.h["0"].register_forward_pre_hook(look)
    with engine.zero.gathered():
        masters = {n: p.detach().clone() for n, p in params.items()}
    gen = torch.Generator().manual_seed(7 + topo.dp_rank)
    losses, ledgers = [], []
    for _ in range(3):
        ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=gen)
        engine.comm.reset()
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ledgers.append(dict(engine.comm.bytes))
    with engine.zero.gathered():
        final = [p.detach().clone() for p in model.parameters()]
    numel = {n: params[n].numel() for n in params}
    return losses, final, seen, {n: masters[n] for n in seen}, sorted(names), ledgers, numel


@pytest.fixture(scope="module")
def runs():
    return {flag: run_distributed(_train, 2, flag)[0] for flag in (True, False)}


def test_gathered_fp8_weights_are_e4m3_values_within_its_error(runs):
    _, _, seen, masters, names, _, _ = runs[True]
    checked = 0
    for n, w in seen.items():
        m = masters[n]
        if n in names:
            s = (448.0 / m.abs().max().float()).double()  # the weight's fp32 scale, computed as fp8.py does
            assert torch.equal((w * s).to(E4M3).double() / s, w), n  # an e4m3 value times the scale
            assert not torch.equal(w, m), n  # really quantized
            assert ((w - m).abs() <= U * m.abs() + SUBNORMAL / 2 / s + 1e-15).all(), n
            checked += 1
        else:
            assert torch.equal(w, m), n  # norms and biases: exact
    assert checked == 4  # h.0's qkv, proj, fc, fc-out


def test_fp8_training_equals_fp8_training_with_full_precision_gathers(runs):
    (l1, p1, *_), (l2, p2, *_) = runs[True], runs[False]
    assert max(abs(a - b) / abs(b) for a, b in zip(l1, l2)) < 1e-6  # the scales' fp32 rounding, not e4m3's 2^-4
    # AdamW divides each gradient by its own running magnitude, so on elements whose gradient is near zero the
    # scales' 1e-7 becomes a larger share of the update (measured: 4e-6 absolute on weights of 0.06 after 3
    # steps); still 600x below e4m3's own 2^-4.
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(p1, p2)) < 1e-4


def test_the_ledger_counts_one_byte_per_fp8_element(runs):
    *_, names, ledgers, numel = runs[True]
    *_, ledgers_full, _ = runs[False]
    n_fp8 = sum(numel[n] for n in names)
    # Each step gathers every block twice (forward, backward): over dp 2 a rank sends half of each gather.
    for step, (mine, full) in enumerate(zip(ledgers, ledgers_full)):
        assert mine["all_gather_fp8"] == pytest.approx(2 * n_fp8 / 2 * 1), step
        # The full-precision gathers lose exactly those elements' 8 bytes (fp64), forward and backward; the
        # first step also verifies the order with 8-byte all-gathers, the same in both runs.
        assert full["all_gather"] - mine["all_gather"] == pytest.approx(2 * n_fp8 / 2 * 8), step
        assert mine["all_reduce"] > full.get("all_reduce", 0)  # the per-step amax all-reduce (one fp32 per weight)


def _refused(stage, recipe, qwz):
    topo = Topology.build(dp=2)
    try:
        ZeroEngine(_model(topo, recipe), topo, stage=stage, fp8_all_gather=True, quantized_weights=qwz)
    except ValueError as err:
        return str(err)
    return "not refused"


@pytest.mark.parametrize("stage,recipe,qwz,words", [(2, "tensorwise", False, "needs zero.stage = 3"),
                                                    (3, "rowwise", False, "train.fp8 = 'tensorwise'"),
                                                    (3, "tensorwise", True, "quantized_weights")])
def test_refusals_name_the_field(stage, recipe, qwz, words):
    message = run_distributed(_refused, 2, stage, recipe, qwz)[0]
    assert "zero.fp8_all_gather" in message and words in message, message


def _fit(fp8_gather: bool):
    from recipe_helpers import tiny_resolved

    from megazoo.recipes.training.trainer import Trainer
    res = tiny_resolved(train={"steps": 2, "precision": "fp32", "fp8": "tensorwise"}, parallel={"dp": 2},
                        zero={"stage": 3, "fp8_all_gather": fp8_gather}, model={"n_layer": 2})
    trainer = Trainer(res, Topology.build(dp=2))
    losses = trainer.fit().losses
    return losses, trainer.zero.comm.bytes.get("all_gather_fp8", 0.0)


def test_the_recipe_switch_reaches_the_trainer_and_is_refused_where_it_cannot_run():
    from recipe_helpers import tiny_resolved

    from megazoo.recipes.config import RecipeError
    (on, fp8_bytes), (off, none) = (run_distributed(_fit, 2, flag)[0] for flag in (True, False))
    assert fp8_bytes > 0 and none == 0.0
    assert abs(on[0] - off[0]) / off[0] < 1e-6  # fp32: the first forward differs by the scales' rounding only
    assert abs(on[1] - off[1]) / off[1] < 1e-4  # after one AdamW step (see the fp64 test above)
    with pytest.raises(RecipeError, match=r"zero.fp8_all_gather = true needs zero.stage = 3 and train.fp8 = "
                                          r"'tensorwise' .*got stage 3, train.fp8 = 'rowwise'"):
        tiny_resolved(train={"fp8": "rowwise"}, zero={"stage": 3, "fp8_all_gather": True})
