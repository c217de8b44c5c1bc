"""What an MoE run shows per step (recipes/training/moe_metrics.py): the router losses and each MoE layer's most /
least loaded expert's share (max/mean, min/mean of the step's global counts) and dropped assignments, equal for
every layout (fp64, 1e-10 against one process), in metrics.jsonl, the progress line and `megazoo plot`."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_resolved

from megazoo.models.moe import MoE
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.metrics import MetricsLog
from megazoo.recipes.training.moe_metrics import progress_fields
from megazoo.recipes.training.plot import figure, plot_runs
from megazoo.recipes.training.trainer import Trainer

MOE = {"preset": "llama-tiny", "n_layer": 3, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "moe_first_dense": 1,
       "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 0.01, "dropout": 0.0, "attn_dropout": 0.0}
STEPS = 2
FIELDS = ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min", "moe_dropped")


def _res(parallel: dict, micro_batch: int, grad_accum: int, model: dict | None = None):
    return tiny_resolved(model={**MOE, **(model or {})}, parallel=parallel,
                         train={"steps": STEPS, "micro_batch": micro_batch, "grad_accum": grad_accum})


def _metrics(res) -> list[dict]:
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    return [trainer.train_step(step) for step in range(STEPS)]


def _on_ranks(res) -> list[list[dict]]:
    return run_distributed(lambda: _metrics(res), res.world_size)


def assert_same_moe_fields(got: dict, ref: dict):
    assert [k for k in FIELDS if k in got] == [k for k in FIELDS if k in ref]
    assert got["moe_layers"] == ref["moe_layers"] == [1, 2]
    for key in FIELDS:
        if key in ref:
            torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                       torch.tensor(ref[key], dtype=torch.float64), rtol=1e-10, atol=0, msg=key)


def test_one_process_reports_the_blocks_own_counts():
    """The figures of one step are those of the MoE blocks' counts over the step's micro-batches (read here from
    the blocks themselves, forward by forward), and the aux loss the model pools into its training loss."""
    res = _res({}, 4, 2)
    trainer = Trainer(res, Topology.solo())
    batches = trainer._batches(trainer.data.train, trainer.sampler.indices_for_step(0), 0)
    counts, aux = {1: 0, 2: 0}, 0.0
    trainer._set_mode(True)
    with torch.no_grad():
        for inputs, targets in batches:
            trainer.model(inputs)
            stats = trainer.model.moe_stats()
            for layer, s in zip((1, 2), stats):
                counts[layer] = counts[layer] + s.counts
            from megazoo.models.moe import load_balancing_loss
            aux += float(load_balancing_loss(stats, 4)) / len(batches)
    trainer.moe.slots(1)  # drop what the reference forwards accumulated
    got = trainer.train_step(0)
    for j, layer in enumerate((1, 2)):
        c = counts[layer].double()
        assert c.sum() == 2 * 4 * res.recipe.train.seq_len * 2  # top-2 of every token of both micro-batches
        assert got["moe_load_max"][j] == pytest.approx(float(c.max() / c.mean()), rel=1e-12)
        assert got["moe_load_min"][j] == pytest.approx(float(c.min() / c.mean()), rel=1e-12)
    assert got["moe_aux_loss"] == pytest.approx(aux, rel=1e-12)
    assert got["moe_z_loss"] > 0 and "moe_dropped" not in got
    assert max(got["moe_load_max"]) > 1.0 > min(got["moe_load_min"])


@pytest.fixture(scope="module")
def reference():
    return _metrics(_res({}, 8, 1))


@pytest.mark.parametrize("parallel, micro_batch", [
    ({"dp": 2, "ep": 2}, 4), ({"dp": 2}, 4), ({"tp": 2, "sequence_parallel": True}, 8), ({"tp": 2}, 8),
    ({"cp": 2, "ep": 2}, 8)], ids=["ep2", "ep1-dp2", "tp2-sp", "tp2", "cp2-ep2"])
def test_layouts_report_the_reference_figures(reference, parallel, micro_batch):
    for rank_metrics in _on_ranks(_res(parallel, micro_batch, 1)):
        for got, ref in zip(rank_metrics, reference):
            assert_same_moe_fields(got, ref)


def test_pipeline_stages_report_every_layer():
    """pp 2 (one MoE layer per stage, the "layer" scope): each stage's layers and losses reach every rank's record."""
    model = {"moe_aux_loss_scope": "layer", "moe_first_dense": 0, "n_layer": 2}
    ref = _metrics(_res({}, 4, 2, model))
    for rank_metrics in _on_ranks(_res({"pp": 2}, 4, 2, model)):
        for got, want in zip(rank_metrics, ref):
            assert got["moe_layers"] == [0, 1]
            for key in FIELDS:
                if key in want:
                    torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                               torch.tensor(want[key], dtype=torch.float64), rtol=1e-10, atol=0)


def test_dropped_tokens_at_ep2_equal_one_process():
    """A capacity factor drops per micro-batch of a rank: ep 2 (dp 2, micro 4) drops what one process running the
    same micro-batches one after another drops; loads are counted before dropping."""
    model = {"moe_capacity_factor": 1.0, "moe_aux_loss_coef": 0.0, "moe_z_loss_coef": 0.0}
    ref = _metrics(_res({}, 4, 2, model))
    assert sum(ref[0]["moe_dropped"]) > 0 and "moe_z_loss" not in ref[0]
    for rank_metrics in _on_ranks(_res({"dp": 2, "ep": 2}, 4, 1, model)):
        for got, want in zip(rank_metrics, ref):
            assert got["moe_dropped"] == want["moe_dropped"]
            # the padded capacity slots travel by static splits at ep 2 and compute the same function
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-10)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-10)
            assert_same_moe_fields({k: v for k, v in got.items() if k != "moe_aux_loss"},
                                   {k: v for k, v in want.items() if k != "moe_aux_loss"})


def test_metrics_file_progress_line_and_plot(tmp_path):
    """metrics.jsonl carries the fields, the progress line shows them, and `megazoo plot` draws the experts' load
    per MoE layer over the steps (and the aux loss)."""
    res = _res({}, 8, 1, {"moe_capacity_factor": 1.5})
    trainer = Trainer(res, Topology.solo())
    trainer.fit(log=MetricsLog(tmp_path, enabled=True))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(len(r["moe_load_max"]) == 2 and "moe_aux_loss" in r and "moe_dropped" in r for r in records)
    line = progress_fields(records[0])
    assert line["aux"] == f"{records[0]['moe_aux_loss']:.4f}"
    assert line["load_max"] == f"{max(records[0]['moe_load_max']):.2f}"
    fig = figure({"moe": records, "dense": [{"step": 0, "loss": 1.0}]})
    titles = {ax.get_title(): ax for ax in fig.axes}
    load = titles["expert load per MoE layer (max/mean solid, min/mean dashed)"]
    assert len(load.lines) == 4  # max and min of layers 1 and 2 of the MoE run; nothing from the dense run
    assert list(load.lines[0].get_ydata()) == [r["moe_load_max"][0] for r in records]
    assert list(titles["router aux loss"].lines[0].get_ydata()) == [r["moe_aux_loss"] for r in records]
    out = plot_runs({"moe": records}, tmp_path / "runs.png")
    assert out.stat().st_size > 0
    assert len(figure({"dense": [{"step": 0, "loss": 1.0}]}).axes) == 4  # dense runs keep the four panels


def test_hooks_see_every_moe_block():
    trainer = Trainer(_res({}, 8, 1), Topology.solo())
    assert [j for j, mlp in trainer.moe.blocks[0]] == [0, 1]
    assert all(isinstance(mlp, MoE) for _, mlp in trainer.moe.blocks[0])


@pytest.mark.parametrize("precision", ["fp64", "fp16"])
def test_layer_scope_weighs_router_losses_as_the_loss(precision):
    """With one MoE layer the "layer" scope (router losses injected in backward, as under pipelines) is the "model"
    scope's function (added to the loss): over two accumulation steps (and fp16's loss scale) the gradients and
    parameters are the same, and the model scope's loss is the layer scope's plus the reported router losses."""
    def run(scope):
        res = tiny_resolved(model={**MOE, "n_layer": 2, "moe_aux_loss_scope": scope},
                            train={"steps": STEPS, "micro_batch": 4, "grad_accum": 2, "precision": precision})
        trainer = Trainer(res, Topology.solo())
        steps = [trainer.train_step(step) for step in range(STEPS)]
        return steps, {k: v.detach().clone() for k, v in trainer.full_state_dict().items()}

    (model_steps, model_params), (layer_steps, layer_params) = run("model"), run("layer")
    tol = 1e-10 if precision == "fp64" else 1e-3
    for m, lay in zip(model_steps, layer_steps):
        assert m["grad_norm"] == pytest.approx(lay["grad_norm"], rel=tol)
        with_router = lay["loss"] + 0.05 * lay["moe_aux_loss"] + 0.01 * lay["moe_z_loss"]
        assert m["loss"] == pytest.approx(with_router, rel=tol)
    for name, value in model_params.items():
        torch.testing.assert_close(layer_params[name], value, rtol=0, atol=tol, msg=name)
