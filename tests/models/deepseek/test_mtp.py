"""DeepSeek-V3's multi-token prediction (models/deepseek/mtp.py): the loss equals a hand-written formula on one
process; the real Trainer at tp 2 (sequence parallel), pp 2 (the MTP module and an embedding copy on the last
stage, untied head) and dp 2 under ZeRO-3 equals one process in fp64 to 1e-10 over 3 steps (losses, gradient norms, every parameter,
the MTP ones included); the layout lists what the model allocates; bad fields and layouts are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from parity_helpers import assert_same_training
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.models.config import ModelConfig
from megazoo.models.flops import model_flops_per_token
from megazoo.models.layout import parameter_layout
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights, named_shards
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.layout_checks import _check_mtp
from megazoo.recipes.training.trainer import Trainer

MODEL = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
         "vocab_size": 300, "dropout": 0.0, "attn_dropout": 0.0, "mtp_depth": 2, "mtp_loss_weight": 0.5}
# DeepSeek-style: MoE from layer 1 with sigmoid + bias routing, so the MTP blocks (layers 2 and 3) are MoE too
MOE = {"n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "moe_first_dense": 1, "moe_router": "sigmoid_bias",
       "moe_bias_update_rate": 0.01}
STEPS = 3


def train_run(res, topo):
    """parity_helpers' record plus each step's reported MTP loss (metrics' mtp_loss)."""
    trainer, mtp = Trainer(res, topo), []
    record = {"losses": [], "norms": []}
    for step in range(res.recipe.train.steps):
        metrics = trainer.train_step(step)
        record["losses"].append(metrics["loss"])
        record["norms"].append(metrics["grad_norm"])
        mtp.append(metrics.get("mtp_loss"))
    return {**record, "val": trainer.evaluate(), "params": trainer.full_state_dict(), "mtp": mtp}


def _cfg(**extra) -> ModelConfig:
    fields = {k: v for k, v in {**MODEL, **extra}.items() if k != "preset"}
    return get_preset("llama-tiny").replace(**fields)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_loss_equals_hand_reference():
    """loss = CE(main) + w / D x sum_k CE_k, CE_k over positions i < s - k with embedded token x_{i+k}, target
    y_{i+k}; written here from the parameters, not through models/deepseek/mtp.py."""
    torch.manual_seed(0)
    cfg = _cfg()
    model = GPT(cfg, Topology.solo(), dtype=torch.float64)
    init_weights(model, 3)
    for p in model.parameters():  # norms away from 1 so that a missing norm shows
        p.data.add_(0.05 * torch.randn_like(p))
    model.train()
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    y = torch.randint(0, cfg.vocab_size, (2, 12))
    got = model.loss(model(x), y, x)

    with torch.no_grad():
        eps, V = cfg.layer_norm_eps, cfg.vocab_size
        head = model.lm_head.weight[:V]
        h = model.wte.weight[x]
        for block in model.h.values():
            h = block(h)
        main = F.cross_entropy((_rms(h, model.ln_f.weight, eps) @ head.T).flatten(0, 1), y.flatten())
        s, extra = x.shape[1], 0.0
        for k, layer in enumerate(model.mtp.layers.values(), start=1):
            e = model.wte.weight[x[:, k:]]  # x_{i+k} for i < s - k
            h = h[:, : s - k]
            h = layer.block(torch.cat([_rms(h, layer.hnorm.weight, eps), _rms(e, layer.enorm.weight, eps)], -1)
                            @ layer.eh_proj.weight.T)
            logits = _rms(h, layer.norm.weight, eps) @ head.T
            extra += F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten())
        want = main + 0.5 / 2 * extra
    assert abs(got.item() - want.item()) < 1e-12
    model.eval()  # evaluation reports the main loss only
    torch.testing.assert_close(model.loss(model(x), y, x), main, rtol=1e-12, atol=0)


def _res(parallel: dict, grad_accum: int, model: dict | None = None, run_dir: str | None = None, stage: int = 1,
         checkpointing: bool = False):
    return tiny_resolved(model={**MODEL, **(model or {})}, parallel=parallel, zero={"stage": stage},
                         run={"dir": run_dir} if run_dir else {},
                         train={"steps": STEPS, "micro_batch": 2, "grad_accum": grad_accum, "eval_batches": 1,
                                "activation_checkpointing": checkpointing})


@pytest.fixture(scope="module")
def reference():
    return train_run(_res({}, 4, MOE), Topology.solo())


def test_reference_trains_the_mtp_module(reference):
    mtp = [n for n in reference["params"] if n.startswith("mtp.")]
    assert "mtp.layers.1.block.mlp.router.expert_bias" in mtp and "mtp.layers.0.eh_proj.weight" in mtp
    assert reference["params"]["mtp.layers.1.block.mlp.router.expert_bias"].abs().max() > 0
    without = train_run(_res({}, 4, {**MOE, "mtp_depth": 0}), Topology.solo())
    # the first step's loss (the same initial main model and batch): main + 0.5 x the reported MTP loss, the mean
    # of two CEs near ln(300) each
    assert without["mtp"] == [None] * STEPS and 5.0 < reference["mtp"][0] < 6.5
    assert abs(reference["losses"][0] - (without["losses"][0] + 0.5 * reference["mtp"][0])) < 1e-12


@pytest.mark.parametrize("parallel, grad_accum, stage, checkpointing", [
    ({"tp": 2, "sequence_parallel": True}, 4, 1, False),  # vocab-parallel head and lookup; eh_proj's gradient summed over tp
    ({"pp": 2}, 4, 1, False),  # the MTP module on the last stage, beside a copy of the embedding summed with the first's
    ({"dp": 2}, 2, 3, False),  # ZeRO-3: the MTP module in the root unit (and the routing bias buffers made real)
    ({"pp": 2}, 4, 1, True),  # activation checkpointing: every block and each MTP depth recomputed in backward
])
def test_mtp_training_equals_one_process(reference, parallel, grad_accum, stage, checkpointing):
    res = _res(parallel, grad_accum, MOE, stage=stage, checkpointing=checkpointing)
    for got in run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), res.world_size):
        assert_same_training(got, reference)
        torch.testing.assert_close(torch.tensor(got["mtp"]), torch.tensor(reference["mtp"]), rtol=1e-10, atol=0)


def test_checkpointed_depths_are_recomputed_with_the_same_gradients():
    """Under activation checkpointing each depth (its norms, projection and block) runs as the decoder's blocks do:
    its forward runs again in backward, keeping only its two inputs; the loss and every gradient (the routing load
    counted twice, as the blocks' is) equal the plain run's, fp64."""
    cfg = _cfg(**MOE)
    x = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))

    def run(checkpointing: bool):
        model = GPT(cfg, Topology.solo(), activation_checkpointing=checkpointing, dtype=torch.float64)
        init_weights(model, 3)
        model.train()
        calls = []
        for layer in model.mtp.layers.values():
            layer.register_forward_pre_hook(lambda *_: calls.append(1))  # (recomputation stops early)
        loss = model.loss(model(x), x.roll(-1, 1), x)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(calls)

    (loss, grads, plain_calls), (again, checkpointed, calls) = run(False), run(True)
    assert (plain_calls, calls) == (2, 4)  # 2 depths, each once more in backward
    torch.testing.assert_close(again, loss, rtol=1e-12, atol=0)
    assert grads.keys() == checkpointed.keys() and any(n.startswith("mtp.") for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-10, atol=1e-14, msg=name)


def test_tied_head_fused_loss_and_pp2_equal_the_plain_loss():
    """A tied head (GPT-2 style): the MTP lookups and heads run after the main fused head + loss, each lookup
    paired with its own head's kept gradient; at pp 2 the last stage's tied copy serves both."""
    def res(fused: str, parallel: dict):
        return tiny_resolved(model={**MODEL, "tie_embeddings": True}, parallel=parallel,
                             train={"steps": STEPS, "micro_batch": 2, "grad_accum": 4, "eval_batches": 1,
                                    "fused_loss": fused})
    plain = train_run(res("off", {}), Topology.solo())
    assert_same_training(train_run(res("on", {}), Topology.solo()), plain)
    pp2 = res("on", {"pp": 2})
    for got in run_distributed(lambda: train_run(pp2, Topology.of(pp2.recipe.parallel)), 2):
        assert_same_training(got, plain)


def _save_after(steps: int, run_dir: str) -> None:
    res = _res({"pp": 2}, 4, MOE, run_dir)
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    for step in range(steps):
        trainer.train_step(step)
    trainer.save_checkpoint(steps)


def test_saved_at_pp2_resumes_in_one_process(tmp_path, reference):
    """The last stage's embedding copy is not saved twice; the MTP weights and their routing bias are."""
    run_distributed(_save_after, 2, 2, str(tmp_path / "saved"))
    trainer = Trainer(_res({}, 4, MOE, str(tmp_path / "resumed")), Topology.solo())
    assert trainer.load_checkpoint(str(tmp_path / "saved" / "checkpoints" / f"step_{2:08d}")) == 2
    result = trainer.fit(start_step=2)
    assert_same_training({"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                          "params": trainer.full_state_dict()},
                         {**reference, "losses": reference["losses"][2:], "norms": reference["norms"][2:]})


def _allocated(cfg, tp, pp, rank):
    topo = Topology.build(dp=1, tp=tp) if tp > 1 else Topology.solo()
    layers = range(0, 1) if rank == 0 and pp == 2 else range(1, 2) if pp == 2 else range(2)
    model = GPT(cfg, topo, layers=layers, with_embedding=rank == 0, with_head=rank == pp - 1, device="meta")
    return [(n, tuple(s.global_shape), s.dim, tuple(p.shape)) for n, p, s in named_shards(model)]


def test_layout_lists_the_mtp_parameters():
    cfg = _cfg(**MOE)
    for pp, rank, stage in ((1, 0, {}), (2, 1, dict(layers=range(1, 2), embedding=False))):
        described = [(p.name, p.shape, p.tp_dim, p.local_shape(1)) for p in parameter_layout(cfg, 1, **stage)]
        assert described == _allocated(cfg, 1, pp, rank)
    assert "wte.weight" in [p.name for p in parameter_layout(cfg, layers=range(1, 2), embedding=False)]
    # the MTP block of layer n_layer is MoE: its idle experts are not active parameters
    assert cfg.num_parameters() - cfg.num_active_parameters() == 3 * (4 - 2) * 3 * 32 * 16


def test_flops_count_the_mtp_modules():
    cfg = _cfg(**MOE)
    d, v, s = cfg.d_model, cfg.vocab_size, 64
    block = 4 * d * d // 2 + 2 * d * d // 2 + cfg.n_experts * d + 2 * 3 * d * 16  # GQA attention, router, 2 experts
    per_depth = 6.0 * (2 * d * d + block + v * d) + 12.0 * s * d
    assert model_flops_per_token(cfg, s) - model_flops_per_token(cfg.replace(mtp_depth=0), s) == 2 * per_depth


def test_bad_fields_and_layouts_are_refused():
    for field, value, words in (("mtp_depth", -1, "integer >= 0"), ("mtp_loss_weight", float("nan"), "finite"),
                                ("mtp_depth", 1.5, "integer >= 0")):
        with pytest.raises(ValueError, match=f"model.{field} = .*{words}"):
            _cfg(**{field: value})
    with pytest.raises(RecipeError, match=r"model.mtp_depth = 2 .* parallel.cp = 2.*valid: mtp_depth = 0 or cp = 1"):
        tiny_resolved(model=MODEL, parallel={"cp": 2, "dp": 1})
    recipe = tiny_recipe(model=MODEL, sft={"path": "chat.jsonl", "packing": True})
    with pytest.raises(RecipeError, match=r"model.mtp_depth = 2 .* sft.packing = true .*valid: sft.packing = false"):
        _check_mtp(recipe, _cfg())
    _check_mtp(tiny_recipe(model=MODEL, sft={"path": "chat.jsonl", "packing": False}), _cfg())  # padded rows: fine
