"""The MoE block's pieces (models/moe/): the grouped-matmul experts equal the per-expert loop (forward and every
gradient) and fall back to it, with the reason, where torch's grouped matmul does not run (fp64, unaligned widths);
the capacity factor drops exactly the rows past each expert's capacity and counts them; the aux and z losses equal
their formulas; the config refuses bad MoE fields with the field, value and what is valid."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from megazoo.models.config import ModelConfig
from megazoo.models.moe import LocalDispatcher, RouterStats, load_balancing_loss, route, z_loss
from megazoo.models.moe.experts import ExpertComputation, expert_ffn, grouped_mm_unsupported
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology

LLAMA = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False, qkv_bias=False, proj_bias=False,
             mlp_bias=False, dropout=0.0, attn_dropout=0.0)
CFG = ModelConfig("moe-test", n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, n_positions=32, vocab_size=97,
                  n_experts=4, moe_top_k=2, moe_d_ff=16, **LLAMA)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _experts_case(dtype, n=4, d=32, f=16, rows=(5, 0, 7, 3), seed=0):
    g = _gen(seed)
    tokens = torch.randn(sum(rows), d, generator=g, dtype=dtype).requires_grad_()
    w_fc = (torch.randn(n, 2 * f, d, generator=g, dtype=dtype) * 0.2).requires_grad_()
    w_proj = (torch.randn(n, d, f, generator=g, dtype=dtype) * 0.2).requires_grad_()
    return tokens, torch.tensor(rows), w_fc, w_proj


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_the_loop_forward_and_backward(dtype):
    assert grouped_mm_unsupported(dtype, 32, 16) is None
    outs = {}
    for impl in ("grouped", "loop"):
        tokens, counts, w_fc, w_proj = _experts_case(dtype)
        y = expert_ffn(tokens, counts, w_fc, w_proj, impl)
        y.pow(2).sum().backward()
        outs[impl] = (y, tokens.grad, w_fc.grad, w_proj.grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref in zip(outs["grouped"], outs["loop"], strict=True):
        assert (got.float() - ref.float()).abs().max().item() <= tol * max(1.0, ref.float().abs().max().item())
    assert outs["grouped"][2][1].abs().max() == 0  # expert 1 received no rows: its gradient is zero


def test_grouped_path_takes_a_plain_sum_gradient():
    tokens, counts, w_fc, w_proj = _experts_case(torch.float32)
    expert_ffn(tokens, counts, w_fc, w_proj, "grouped").sum().backward()  # an expanded (stride 0) gradient
    assert w_fc.grad is not None and torch.isfinite(w_fc.grad).all()


@pytest.mark.parametrize("capability, grouped", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True),
                                                 ((12, 0), False)])
def test_cuda_capability_chooses_the_grouped_matmul_or_the_loop(monkeypatch, capability, grouped):
    """torch's CUDA grouped matmul is a kernel on sm90 / sm100 only (elsewhere torch loops with a host read):
    on other GPUs the experts run our per-expert loop, and the reason names the device's capability."""
    from megazoo.models.moe import experts as mod

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    why = grouped_mm_unsupported(torch.bfloat16, 32, 16, "cuda")
    assert (why is None) == grouped
    if not grouped:
        assert f"sm{capability[0]}{capability[1]}" in why and "sm90 and sm100" in why
    assert grouped_mm_unsupported(torch.bfloat16, 32, 16, "cpu") is None  # no capability to ask
    # expert_ffn follows the same verdict for tokens on that device (here: CPU tokens, asked as if on the GPU)
    monkeypatch.setattr(mod, "cuda_capability", lambda device: capability)
    calls = []
    monkeypatch.setattr(mod, "grouped_swiglu", lambda *a: calls.append(1) or mod.looped_swiglu(*a))
    tokens, counts, w_fc, w_proj = _experts_case(torch.float32)
    expert_ffn(tokens, counts, w_fc, w_proj, "grouped")
    assert calls == ([1] if grouped else [])


def test_fp64_and_unaligned_widths_fall_back_to_the_loop_with_the_reason():
    assert "fp32, bf16 or fp16" in grouped_mm_unsupported(torch.float64, 32, 16)
    assert "multiples of 4" in grouped_mm_unsupported(torch.float32, 30, 16)
    assert "multiples of 8" in grouped_mm_unsupported(torch.bfloat16, 32, 12)
    module = ExpertComputation(4, 32, 16, 0.02, 0.02, "grouped", dtype=torch.float64)
    assert "fp32, bf16 or fp16" in module.fallback
    assert ExpertComputation(4, 32, 16, 0.02, 0.02, "grouped").fallback is None
    tokens, counts, w_fc, w_proj = _experts_case(torch.float64)
    grouped = expert_ffn(tokens, counts, w_fc, w_proj, "grouped")  # runs the loop: exactly equal
    assert torch.equal(grouped, expert_ffn(tokens, counts, w_fc, w_proj, "loop"))


def _model_loss(cfg, dtype=torch.float32, seed=5):
    model = GPT(cfg, Topology.solo(), dtype=dtype)
    init_weights(model, seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=_gen(1))
    loss = model.loss(model(ids), ids)
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, model


def test_whole_model_grouped_equals_loop():
    ref_loss, ref_grads, _ = _model_loss(CFG.replace(moe_experts_impl="loop", moe_aux_loss_coef=0.01))
    loss, grads, _ = _model_loss(CFG.replace(moe_aux_loss_coef=0.01))
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-6), name


def _dispatch_case(factor, t=12, e=4, k=2, d=8):
    g = _gen(4)
    x = torch.randn(t, d, generator=g, dtype=torch.float64)
    weights, indices, _ = route(torch.randn(t, e, generator=g, dtype=torch.float64), k)
    scale = torch.arange(1, e + 1, dtype=torch.float64)
    experts = lambda rows, counts: rows * torch.repeat_interleave(scale, counts)[:, None]  # expert j: x (j + 1)
    return x, weights, indices, LocalDispatcher(e, factor)(x, weights, indices, experts)


def test_capacity_factor_drops_rows_past_capacity_in_token_order_and_counts_them():
    x, weights, indices, done = _dispatch_case(0.5)
    cap = math.ceil(0.5 * 12 * 2 / 4)
    expected, kept = torch.zeros_like(x), [0] * 4
    for t in range(12):  # the reference: tokens in order, each expert keeps its first `cap` rows
        for j in range(2):
            e = indices[t, j].item()
            if kept[e] < cap:
                kept[e] += 1
                expected[t] += weights[t, j] * x[t] * (e + 1)
    routed = torch.bincount(indices.reshape(-1), minlength=4)
    assert torch.equal(done.counts, routed)
    assert done.dropped.item() == (routed - routed.clamp(max=cap)).sum().item() > 0
    assert torch.allclose(done.out, expected, atol=1e-12)
    _, _, _, dropless = _dispatch_case(0.0)
    _, _, _, roomy = _dispatch_case(2.0)  # capacity 12 >= any expert's rows: nothing dropped
    assert roomy.dropped.item() == dropless.dropped.item() == 0 and torch.allclose(roomy.out, dropless.out)


def test_aux_loss_pools_layers_as_transformers_and_z_loss_is_its_formula():
    g = _gen(7)
    logits = [torch.randn(10, 4, generator=g) for _ in range(3)]
    stats = []
    for layer in logits:
        _, indices, _ = route(layer, 2)
        counts = torch.bincount(indices.reshape(-1), minlength=4)
        stats.append(RouterStats.of(layer, counts, torch.zeros((), dtype=torch.int64)))
    theirs = load_balancing_loss_func(tuple(logits), 4, 2)
    assert abs(load_balancing_loss(stats, 4).item() - theirs.item()) < 1e-6
    every = torch.cat(logits)
    assert abs(z_loss(stats).item() - torch.logsumexp(every, -1).pow(2).mean().item()) < 1e-5


def test_training_loss_adds_the_weighted_aux_and_z_losses_eval_does_not():
    cfg = CFG.replace(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
    loss, _, model = _model_loss(cfg)
    stats = model.moe_stats()
    assert len(stats) == 2
    aux = 0.1 * load_balancing_loss(stats, 4) + 0.01 * z_loss(stats)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=_gen(1))
    model.eval()
    with torch.no_grad():
        plain = model.loss(model(ids), ids)
    assert abs(loss.item() - (plain + aux).item()) < 1e-5 and aux.item() > 0


@pytest.mark.parametrize("change, message", [
    (dict(moe_top_k=5), "model.moe_top_k = 5 is larger than model.n_experts = 4; valid: 1..4"),
    (dict(moe_router="sigmoid_bias", moe_n_group=3), "model.moe_n_group = 3 must divide model.n_experts = 4 into groups"),
    (dict(moe_router="topk_softmax"), "model.moe_router = 'topk_softmax' is invalid; valid: 'softmax', 'sigmoid_bias'"),
    (dict(moe_dense_layers=(0, 7)), "model.moe_dense_layers holds [7]: layer indices must be in 0..1"),
    (dict(moe_dense_layers=(0, 1)), "but no layer is MoE"),
    (dict(mlp="gelu"), "needs model.mlp = 'swiglu'"),
    (dict(moe_shared_gate=True), "model.moe_shared_gate = true needs model.moe_shared_experts >= 1"),
    (dict(moe_capacity_factor=-1.0), "model.moe_capacity_factor = -1.0 is invalid"),
    (dict(moe_experts_impl="fast"), "model.moe_experts_impl = 'fast' is invalid; valid: 'grouped', 'loop'"),
    (dict(n_experts=-2), "model.n_experts = -2 is invalid"),
])
def test_bad_moe_fields_are_refused(change, message):
    with pytest.raises(ValueError, match=None) as error:
        CFG.replace(**change)
    assert message in str(error.value)


def test_layer_selection_and_the_tp_check_of_shared_experts():
    cfg = CFG.replace(n_layer=6, moe_first_dense=1, moe_every=2, moe_dense_layers=(3,))
    assert [i for i in range(6) if cfg.moe_layer(i)] == [1, 5]
    shared = CFG.replace(moe_shared_experts=1, moe_shared_d_ff=6)
    with pytest.raises(ValueError, match="parallel.tp = 4 does not divide the shared experts' width"):
        GPT(shared, Topology(tp=4, tp_rank=0), device="meta")


def test_layer_scope_injects_each_layers_own_loss_in_backward():
    """moe_aux_loss_scope = "layer": the value the decoder returns is the cross-entropy alone, and the gradients are
    those of cross-entropy + the mean over MoE layers of each layer's weighted aux and z-losses."""
    from megazoo.models.moe.losses import layer_losses

    layered = CFG.replace(moe_aux_loss_scope="layer", moe_aux_loss_coef=0.3, moe_z_loss_coef=0.05)
    loss, grads, model = _model_loss(layered)
    plain, ref_grads, ref_model = _model_loss(CFG)  # the same weights, no loss added by the decoder
    assert abs(loss.item() - plain.item()) < 1e-6
    ref_model.zero_grad()
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=_gen(1))
    total = ref_model.loss(ref_model(ids), ids)
    total = total + sum(layer_losses(s, 4, 0.3, 0.05, 2) for s in ref_model.moe_stats())
    total.backward()
    for name, param in ref_model.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-5, atol=1e-7), name
    assert not torch.allclose(grads["h.0.mlp.router.weight"], ref_grads["h.0.mlp.router.weight"])


def test_pipeline_stages_need_the_layer_scope():
    from megazoo.models.layout import check_parallel_compat

    pooled = CFG.replace(moe_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="parallel.pp = 2 with model.moe_aux_loss_scope = 'model'"):
        check_parallel_compat(pooled, 1, 2)
    check_parallel_compat(pooled.replace(moe_aux_loss_scope="layer"), 1, 2)
    check_parallel_compat(CFG, 1, 2)  # no auxiliary loss: nothing to pool


def test_bf16_autocast_and_bf16_weights_run_the_grouped_path_close_to_fp32():
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=_gen(1))
    fp32, _, model = _model_loss(CFG)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = model.loss(model(ids), ids)
    autocast.backward()
    assert model.h["0"].mlp.experts.c_fc.weight.grad.dtype == torch.float32
    bf16, grads, _ = _model_loss(CFG, dtype=torch.bfloat16)
    assert abs(autocast.item() - fp32.item()) < 2e-2 and abs(bf16.item() - fp32.item()) < 5e-2
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_lora_on_attention_of_an_moe_model_and_experts_refused():
    from megazoo.models.lora.adapters import attach_lora
    from megazoo.models.lora.config import LoRAConfig, check_lora

    with pytest.raises(ValueError, match=r"lora.targets \['gate', 'down'\] on model moe-test, which has 4 experts"):
        check_lora(LoRAConfig(rank=4, targets=("q", "gate", "down")), CFG)
    model = GPT(CFG, Topology.solo())
    init_weights(model, 0)
    attach_lora(model, LoRAConfig(rank=4, targets=("q", "k", "v", "o")))
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=_gen(1))
    model.loss(model(ids), ids).backward()
    adapters = [n for n, p in model.named_parameters() if "lora" in n and p.grad is not None]
    assert len(adapters) == 2 * 4 * CFG.n_layer
