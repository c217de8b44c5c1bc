"""The ZeRO planner (recipes/planner/zero.py, recipes/planner/shards.py) and `megazoo plan` (recipes/planner/cli.py).

The paper's Table 1 row is checked through the command line, the per-shard Psi against the parameters a
meta-device model really allocates (solo, pipeline stages, and tp=2 on two gloo ranks), the formulas against
hand arithmetic, and every bad flag against its exit code and message.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

from megazoo.models.config import ModelConfig
from megazoo.models.presets import get_preset, presets
from megazoo.parallel.pipeline.partition import uniform_stage_layers
from megazoo.recipes.planner.zero import (FP32_ADAM, GB, MIXED_ADAM, BufferConfig, PlanError, StateBytes, buffer_memory,
                                           communication_volume, format_sig, model_state_memory, plan)
from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.planner.shards import plan_model, shard_parameters

TABLE1 = ["120", "31.4", "16.6", "1.88"]  # ZeRO paper, Table 1: Psi = 7.5B, N = 64, K = 12, GB per device


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def table_rows(text: str) -> dict[int, dict[str, str]]:
    """{stage: {column header: cell}} from the markdown table."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        rows[int(cells["stage"].split()[0])] = cells
    return rows


# ---- the paper's Table 1 -----------------------------------------------------------------------------------

def test_table1_row_printed_exactly(capsys):
    code, out, err = run_cli(capsys, "--params", "7.5e9", "--dp", "64", "--paper")
    assert code == 0, err
    rows = table_rows(out)
    assert [rows[s]["total GB"] for s in range(4)] == TABLE1
    assert "| 0 (baseline) | 15.0 | 15.0 | 90.0 | 120 |" in out
    assert "| 1 (P_os) | 15.0 | 15.0 | 1.41 | 31.4 |" in out
    assert "| 2 (P_os+g) | 15.0 | 0.234 | 1.41 | 16.6 |" in out
    assert "| 3 (P_os+g+p) | 0.234 | 0.234 | 1.41 | 1.88 |" in out
    assert "Psi = 7,500,000,000" in out and "Buffers" in out and "GB = 1e9 bytes" in out


def test_table1_as_json(capsys):
    code, out, _ = run_cli(capsys, "--params", "7.5e9", "--dp", "64", "--json", "--paper")
    assert code == 0
    data = json.loads(out)
    assert data["inputs"]["psi"] == 7_500_000_000 and data["inputs"]["dp"] == 64 and data["inputs"]["k"] == 12
    totals = [s["total_bytes"] for s in data["stages"]]
    assert totals == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert [format_sig(t / GB) for t in totals] == TABLE1
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]


def test_single_stage_row(capsys):
    code, out, _ = run_cli(capsys, "--params", "7.5e9", "--dp", "64", "--zero", "2", "--paper")
    assert code == 0 and list(table_rows(out)) == [2] and table_rows(out)[2]["total GB"] == "16.6"


@pytest.mark.parametrize("x, text", [(120.0, "120"), (31.40625, "31.4"), (16.640625, "16.6"), (1.875, "1.88"),
                                     (0.234375, "0.234"), (15.0, "15.0"), (9.996, "10.0"), (1234.5, "1235"),
                                     (0.0, "0"), (0.000123456, "0.000123")])
def test_format_sig(x, text):
    assert format_sig(x) == text


# ---- formulas against hand arithmetic ------------------------------------------------------------------------

@pytest.mark.parametrize("state", [MIXED_ADAM, FP32_ADAM, StateBytes(2, 2, 16)])
def test_memory_formulas_per_stage(state):
    psi, n = 1_000_000, 8
    p, g, k = state.params, state.grads, state.optimizer
    expected = {0: (p * psi, g * psi, k * psi), 1: (p * psi, g * psi, k * psi / n),
                2: (p * psi, g * psi / n, k * psi / n), 3: (p * psi / n, g * psi / n, k * psi / n)}
    for stage, (pb, gb, ob) in expected.items():
        m = model_state_memory(psi, n, stage, state)
        assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (pb, gb, ob)
        assert m.total_bytes == m.device_bytes == pb + gb + ob and m.cpu_bytes == 0
    # the paper's closed forms for mixed precision (K = 12)
    psi, n, k = 7.5e9, 64, 12
    assert model_state_memory(psi, n, 0).total_bytes == (2 + 2 + k) * psi
    assert model_state_memory(psi, n, 1).total_bytes == 2 * psi + 2 * psi + k * psi / n
    assert model_state_memory(psi, n, 2).total_bytes == 2 * psi + (2 + k) * psi / n
    assert model_state_memory(psi, n, 3).total_bytes == (2 + 2 + k) * psi / n


def test_fp32_adam_is_16_bytes_without_master_copy():
    assert (FP32_ADAM.params, FP32_ADAM.grads, FP32_ADAM.optimizer) == (4, 4, 8)
    assert model_state_memory(1000, 1, 0, FP32_ADAM).total_bytes == 16_000


def test_memory_falls_with_stage_and_with_dp():
    psi = 1_000_000_000
    for n in (2, 4, 64):
        totals = [model_state_memory(psi, n, s).total_bytes for s in range(4)]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    for s in (1, 2, 3):
        by_dp = [model_state_memory(psi, n, s).total_bytes for n in (1, 2, 4, 8, 64, 1024)]
        assert all(a > b for a, b in zip(by_dp, by_dp[1:])), s
    assert len({model_state_memory(psi, n, 0).total_bytes for n in (1, 8, 64)}) == 1  # baseline: no partition


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_moves_exactly_the_optimizer_states_to_cpu(stage):
    psi, n, k = 7_500_000_000, 64, 12
    on, off = model_state_memory(psi, n, stage), model_state_memory(psi, n, stage, offload=True)
    moved = k * psi / (n if stage >= 1 else 1)
    assert off.cpu_bytes == moved and on.device_bytes - off.device_bytes == moved
    assert off.params_bytes == on.params_bytes and off.grads_bytes == on.grads_bytes
    assert off.total_bytes == on.total_bytes  # nothing vanishes, it moves


def test_offload_table_has_device_and_cpu_columns(capsys):
    code, out, _ = run_cli(capsys, "--params", "7.5e9", "--dp", "64", "--zero", "2", "--offload", "--paper")
    row = table_rows(out)[2]
    assert code == 0 and row["device GB"] == "15.2" and row["CPU GB"] == "1.41" and "total GB" not in row


def test_communication_volume():
    psi, n = 1_000_000, 8
    one = psi * (n - 1) / n
    c = {s: communication_volume(psi, n, s) for s in range(4)}
    assert c[0].all_reduce_elements == 2 * one and c[0].reduce_scatter_elements == c[0].all_gather_elements == 0
    for s in (1, 2):
        assert (c[s].reduce_scatter_elements, c[s].all_gather_elements, c[s].all_reduce_elements) == (one, one, 0)
    assert (c[3].reduce_scatter_elements, c[3].all_gather_elements) == (one, 2 * one)
    assert c[0].elements == c[1].elements == c[2].elements == 2 * one
    assert c[3].elements == 1.5 * c[1].elements == 1.5 * c[2].elements
    assert [c[s].bytes for s in range(4)] == [2 * c[s].elements for s in range(4)]  # fp16/bf16: 2 bytes
    assert [c[s].factor for s in range(4)] == [2, 2, 2, 3]
    assert communication_volume(psi, n, 1, FP32_ADAM).bytes == 4 * 2 * one
    assert communication_volume(psi, 1, 3).elements == 0  # nobody to talk to
    # accumulation: stages 0 and 1 reduce once per step, stage 2 per micro-batch, stage 3 everything per micro-batch
    acc = {s: communication_volume(psi, n, s, grad_accum=4) for s in range(4)}
    assert acc[0].elements == acc[1].elements == 2 * one
    assert acc[2].elements == 5 * one and acc[3].elements == 12 * one


def test_buffers_are_reported_apart_and_capped_at_psi():
    b = BufferConfig()
    assert (b.reduce_bucket, b.allgather_bucket, b.prefetch, b.persistence_threshold) == (5e8, 5e8, 5e7, 1e5)
    big = [buffer_memory(7_500_000_000, s) for s in range(4)]
    assert [x.total_bytes for x in big[:3]] == [1e9, 2e9, 2e9]
    assert big[3].prefetch_bytes == 1e8 and big[3].persistent_bytes is None  # unknown without a tensor list
    small = buffer_memory(1000, 1)
    assert small.reduce_bucket_bytes == small.allgather_bucket_bytes == 2000
    p = plan(7_500_000_000, 64)
    assert p.stages[0].memory.total_bytes == 120e9  # the buffers never enter the model states


# ---- Psi per tensor/pipeline shard ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(presets()))
def test_solo_psi_is_the_padded_parameter_count(name):
    cfg = get_preset(name)
    shard = shard_parameters(cfg)
    assert shard.psi == cfg.num_parameters(cfg.padded_vocab(1)) and shard.padded_vocab == cfg.padded_vocab(1)
    assert shard.psi > cfg.num_parameters() or cfg.vocab_size % cfg.vocab_multiple == 0  # padded rows count


@pytest.mark.parametrize("name", ["gpt2-117m", "tnlg-17b", "gpt3-175b"])
def test_tp2_halves_sharded_and_keeps_replicated(name):
    cfg = get_preset(name)
    one, two = shard_parameters(cfg, 1).stages[0], shard_parameters(cfg, 2).stages[0]
    assert two.replicated == one.replicated
    extra_rows = cfg.padded_vocab(2) - cfg.padded_vocab(1)  # padding to 128 x tp may add rows
    assert 2 * two.sharded == one.sharded + extra_rows * cfg.d_model
    same_vocab = cfg.replace(vocab_size=cfg.padded_vocab(2))  # no extra padding: exactly half
    a, b = shard_parameters(same_vocab, 1).stages[0], shard_parameters(same_vocab, 2).stages[0]
    assert 2 * b.sharded == a.sharded and b.replicated == a.replicated


def test_pipeline_stages_split_layers_and_hold_embeddings():
    assert uniform_stage_layers(78, 4) == [range(0, 20), range(20, 40), range(40, 59), range(59, 78)]
    cfg = get_preset("gpt2-117m")
    shard = shard_parameters(cfg, 1, 4)
    names = [{t.name for t in s.tensors} for s in shard.stages]
    assert {"wte.weight", "wpe.weight"} <= names[0] and "ln_f.weight" not in names[0]
    assert {"wte.weight", "ln_f.weight", "ln_f.bias"} <= names[3] and "wpe.weight" not in names[3]
    assert not any(n.startswith(("wte", "wpe", "ln_f")) for n in names[1] | names[2])
    # the tied word embedding is allocated on the first and the last stage
    assert sum(s.numel for s in shard.stages) == cfg.num_parameters(cfg.padded_vocab(1)) \
        + cfg.padded_vocab(1) * cfg.d_model
    assert shard.psi == max(s.numel for s in shard.stages) == shard.stages[0].numel


def _meta_counts(cfg: ModelConfig, topo, pp: int) -> list[list[tuple[str, int]]]:
    import torch

    from megazoo.models.transformer import GPT
    stages = []
    for rank, layers in enumerate(uniform_stage_layers(cfg.n_layer, pp)):
        model = GPT(cfg, topo, layers=layers, with_embedding=rank == 0, with_head=rank == pp - 1,
                    device=torch.device("meta"))
        stages.append(sorted((n, p.numel()) for n, p in model.named_parameters()))
    return stages


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_shard_matches_what_a_meta_model_allocates(pp):
    from megazoo.parallel.topology import Topology
    cfg = get_preset("gpt2-tiny")
    planned = [sorted((t.name, t.numel) for t in s.tensors) for s in shard_parameters(cfg, 1, pp).stages]
    assert planned == _meta_counts(cfg, Topology.solo(), pp)


def _tp2_counts(name: str):
    from megazoo.parallel.topology import Topology
    return _meta_counts(get_preset(name), Topology.build(dp=1, tp=2), 2)


def test_tp2_shard_matches_a_meta_model_on_two_ranks():
    from harness import run_distributed
    shard = shard_parameters(get_preset("gpt2-tiny"), 2, 2)
    planned = [sorted((t.name, t.numel) for t in s.tensors) for s in shard.stages]
    for measured in run_distributed(_tp2_counts, 2, "gpt2-tiny"):
        assert measured == planned


def test_plan_model_uses_the_peak_shard():
    cfg = get_preset("tnlg-17b")
    p = plan_model(cfg, 64, 4, 1, (3,))
    assert p.psi == shard_parameters(cfg, 4, 1).psi and p.stages[0].memory.total_bytes == 16 * p.psi / 64
    assert p.stages[0].buffers.persistent_bytes > 0  # LayerNorms and biases stay whole under stage 3


# ---- the command line ------------------------------------------------------------------------------------------

def test_tnlg_17b_tp4_zero3(capsys):
    code, out, err = run_cli(capsys, "--model", "tnlg-17b", "--dp", "64", "--tp", "4", "--pp", "1", "--zero", "3",
                             "--paper")
    assert code == 0, err
    psi = shard_parameters(get_preset("tnlg-17b"), 4, 1).psi
    assert f"Psi = {psi:,} parameters per device: tnlg-17b with tp=4 pp=1" in out
    row = table_rows(out)[3]
    assert row["total GB"] == format_sig(16 * psi / 64 / GB) and "3Psi(N-1)/N" in row["comm/step (elements sent)"]
    assert "persistent params" in out


def test_model_without_zero_prints_every_stage(capsys):
    code, out, _ = run_cli(capsys, "--model", "gpt2-1.5b", "--dp", "8")
    assert code == 0 and list(table_rows(out)) == [0, 1, 2, 3]
    code, out, _ = run_cli(capsys, "--model", "megatron-8.3b", "--dp", "8", "--tp", "8", "--pp", "4", "--json")
    data = json.loads(out)
    assert code == 0 and data["inputs"]["tp"] == 8 and len(data["shard"]["stage_psi"]) == 4


def test_register_adds_the_plan_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="megazoo")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--params", "7.5e9", "--dp", "64", "--zero", "3", "--paper"])
    assert args.func(args) == 0 and "| 1.88 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needles", [
    (["--model", "gpt-7", "--dp", "2"], ["--model 'gpt-7'", "valid:", "tnlg-17b", "gpt2-117m"]),
    (["--model", "tnlg-17b", "--dp", "64", "--tp", "8"], ["--tp 8", "28 attention heads", "1, 2, 4, 7, 14, 28"]),
    (["--model", "gpt2-tiny", "--pp", "5"], ["--pp 5", "4 blocks", "valid --pp: 1..4"]),
    (["--params", "1e9", "--dp", "0"], ["--dp 0", "integer >= 1"]),
    (["--params", "1e9", "--dp", "-3"], ["--dp -3", "integer >= 1"]),
    (["--params", "1e9", "--dp", "two"], ["--dp 'two'", "integer >= 1"]),
    (["--model", "gpt2-tiny", "--params", "1e9"], ["exactly one of --model", "--params", "both"]),
    (["--dp", "4"], ["exactly one of --model", "--params"]),
    (["--params", "1e9", "--zero", "4"], ["--zero 4", "valid: 0, 1, 2, 3"]),
    (["--params", "1e9", "--zero", "-1"], ["--zero -1", "valid: 0, 1, 2, 3"]),
    (["--params", "1.5", "--dp", "2"], ["--params 1.5", "integer"]),
    (["--params", "1e9", "--tp", "2"], ["--tp 2", "need --model"]),
])
def test_bad_input_exit_code_and_message(capsys, argv, needles):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("megazoo plan: error: ")
    for needle in needles:
        assert needle in err, (needle, err)


def test_planner_rejects_bad_arguments_directly():
    with pytest.raises(PlanError, match=re.escape("zero stage 4")):
        model_state_memory(10, 2, 4)
    with pytest.raises(PlanError, match="dp = 0"):
        communication_volume(10, 0, 1)
    with pytest.raises(PlanError, match="valid tp: 1, 2, 4, 7, 14, 28"):
        shard_parameters(get_preset("tnlg-17b"), 8)
