"""kernels.attention = "recompute" (kernels/recompute_attention.py): SDPA that keeps q, k, v and replays the
same dropout mask in backward.

Exactness in fp64 to 1e-10, dropout on and off: outputs and gradients equal the plain `torch` path's (SDPA with
the same seed) and an explicit masked softmax that draws the same mask (CPU SDPA's math path draws
bernoulli(1 - p) over the probabilities' shape from the default generator: the reference replays that draw), with
other random draws between forward and backward so a backward that did not restore the generator would fail.
Memory: in a real CPU run it keeps less for backward than SDPA's math path (saved-tensor bytes, by storage).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import pytest
import torch

from megazoo.kernels import KernelChoice, resolve_kernels
from megazoo.kernels.attention import attention_sdpa
from megazoo.kernels.dispatch import resolve_op
from megazoo.kernels.recompute_attention import attention_recompute
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT, Block
from megazoo.models.weights import init_weights
from megazoo.parallel.tensor.random import TPRNGTracker
from megazoo.parallel.topology import Topology

F64 = torch.float64


def same_mask_reference(q, k, v, p):
    """Causal attention with dropout written out, drawing its mask as CPU SDPA's math path does."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    if p > 0:
        probs = probs * torch.empty_like(probs).bernoulli_(1 - p) / (1 - p)
    return probs @ v


def _qkv(dtype=F64, seed=0, shape=(2, 3, 19, 8)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for _ in range(4)]  # q, k, v, dy


def _run(fn, q, k, v, dy, p, seed=1234, needs=(True, True, True), forward_context=contextlib.nullcontext):
    """fn's output and input gradients, with random draws between forward and backward; the generator state
    right after forward and after backward. Only the forward runs inside `forward_context` (as in training)."""
    inputs = [t.clone().requires_grad_(n) for t, n in zip((q, k, v), needs)]
    torch.manual_seed(seed)
    with forward_context():
        y = fn(*inputs, p)
    after_forward = torch.get_rng_state()
    torch.rand(1000)  # someone else draws before backward (the next layer's dropout, another micro-batch)
    before_backward = torch.get_rng_state()
    y.backward(dy)
    assert torch.equal(torch.get_rng_state(), before_backward), "backward must leave the generator as it found it"
    return y.detach(), [t.grad for t in inputs], after_forward


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_outputs_and_gradients_equal_sdpa_and_the_same_mask_reference(p):
    q, k, v, dy = _qkv()
    y, grads, state = _run(attention_recompute, q, k, v, dy, p)
    for name, ref in (("sdpa", attention_sdpa), ("same-mask reference", same_mask_reference)):
        y_ref, grads_ref, state_ref = _run(ref, q, k, v, dy, p)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10, msg=lambda m: f"y vs {name}: {m}")
        for g_name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m: f"{g_name} vs {name}: {m}")
        assert torch.equal(state, state_ref), f"the forward draws what {name} draws, no more"
    if p > 0:  # the mask really is random: another seed gives another output
        other, _, _ = _run(attention_recompute, q, k, v, dy, p, seed=99)
        assert (other - y).abs().max() > 1e-3


def test_gradients_of_inputs_that_need_none_are_none():
    q, k, v, dy = _qkv()
    _, grads, _ = _run(attention_recompute, q, k, v, dy, 0.25, needs=(True, False, True))
    _, ref, _ = _run(attention_sdpa, q, k, v, dy, 0.25, needs=(True, False, True))
    assert grads[1] is None
    torch.testing.assert_close(grads[0], ref[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(grads[2], ref[2], rtol=0, atol=1e-10)


def test_autocast_is_replayed_in_backward():
    """Forward under bf16 autocast, backward outside it (as the Trainer does): the recomputation runs in bf16 as
    the forward did, bit-equal to the plain path."""
    q, k, v, dy = _qkv(dtype=torch.float32)
    bf16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    y, grads, _ = _run(attention_recompute, q, k, v, dy.bfloat16(), 0.25, forward_context=bf16)
    y_ref, grads_ref, _ = _run(attention_sdpa, q, k, v, dy.bfloat16(), 0.25, forward_context=bf16)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    for got, want in zip(grads, grads_ref):
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_on_cuda_it_replays_the_gpu_kernels_dropout_exactly(dtype):
    """On a GPU SDPA runs FlashAttention / the memory-efficient kernel, whose mask comes from the CUDA generator's
    Philox state: restoring that state replays it, so outputs and gradients equal the plain path's bit for bit."""
    g = torch.Generator("cuda").manual_seed(5)
    q, k, v, dy = (torch.randn(2, 4, 256, 64, generator=g, device="cuda", dtype=dtype) for _ in range(4))
    results = []
    for fn in (attention_recompute, attention_sdpa):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.cuda.manual_seed(1234)
        y = fn(*inputs, 0.2)
        torch.rand(1000, device="cuda")  # other draws before backward
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in inputs])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_dispatch_picks_it_only_when_asked():
    chosen = resolve_op("attention", KernelChoice(overrides={"attention": "recompute"}), torch.device("cpu"))
    assert chosen.name == "recompute" and chosen.fn is attention_recompute
    assert "recomputed in backward" in chosen.detail and chosen.why == "kernels.attention = 'recompute'"
    for prefer in ("auto", "torch", "apex", "triton"):  # SDPA stays the default; no family preference swaps it
        assert resolve_op("attention", KernelChoice(prefer), torch.device("cpu")).name == "torch"


TINY = get_preset("gpt2-tiny").replace(vocab_size=96, n_layer=2, n_positions=64, dropout=0.1, attn_dropout=0.2)


def _model_step(attention: str, checkpointing: bool):
    """Loss and parameter gradients of one fp64 step of a 2-block GPT with dropout everywhere."""
    kernels = resolve_kernels(KernelChoice(overrides={"attention": attention}), "cpu")
    topo = Topology.solo()
    model = GPT(TINY, topo, rng=TPRNGTracker(7, 0), activation_checkpointing=checkpointing, dtype=F64,
                kernels=kernels)
    init_weights(model, 7)
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(11)
    loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_model_trains_the_same_with_it(checkpointing):
    """The attention dropout draws from the tensor-parallel stream's fork (parallel/tensor/random.py); under
    activation checkpointing the block's forward is replayed too. Loss and every gradient equal SDPA's."""
    loss, grads = _model_step("recompute", checkpointing)
    loss_ref, grads_ref = _model_step("torch", checkpointing)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-10)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


class SavedBytes:
    """Bytes that autograd keeps saved for backward, counted once per storage (views of one tensor cost it once).
    Only what is still saved counts: a graph built and dropped inside the call (the recomputing kernel's forward)
    frees its saved tensors, and their weak references die."""

    def __init__(self):
        self.saved: list[tuple[weakref.ref, int, int]] = []

    def pack(self, t: torch.Tensor):
        # An alias without grad_fn: a saved output held as itself would hold its own node, a cycle through C++.
        alias = t.detach()
        self.saved.append((weakref.ref(alias), t.untyped_storage()._cdata, t.untyped_storage().nbytes()))
        return alias

    @property
    def total(self) -> int:
        return sum(dict((key, n) for ref, key, n in self.saved if ref() is not None).values())


def _saved_bytes(fn) -> int:
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = fn()
    total = counter.total  # while `out` keeps its graph, and what the graph saved, alive
    del out
    return total


def test_it_keeps_only_q_k_v_where_sdpa_keeps_the_probabilities():
    """Real (not fake) CPU tensors. The attention core alone: q, k, v are views of one QKV tensor, which is all
    the recomputing kernel keeps; SDPA's math path (dropout on the CPU) keeps (b, h, s, s) tensors too. One
    whole block with dropout: the recomputing kernel saves less by more than the scores of one layer."""
    b, h, s, hd = 2, 4, 64, 16
    qkv = torch.randn(b, s, 3 * h * hd, dtype=F64, requires_grad=True)

    def core(fn):
        q, k, v = (t.view(b, s, h, hd).transpose(1, 2) for t in qkv.split(h * hd, dim=-1))
        return lambda: fn(q, k, v, 0.1)

    torch.manual_seed(0)
    assert _saved_bytes(core(attention_recompute)) == qkv.numel() * 8  # q, k, v: one storage
    scores = b * h * s * s * 8
    assert _saved_bytes(core(attention_sdpa)) >= qkv.numel() * 8 + 2 * scores  # + probabilities, mask, ...

    cfg = TINY.replace(n_positions=s)
    x = torch.randn(b, s, cfg.d_model, dtype=F64, requires_grad=True)

    def block_bytes(attention):
        kernels = resolve_kernels(KernelChoice(overrides={"attention": attention}), "cpu")
        block = Block(cfg, Topology.solo(), TPRNGTracker(0, 0), dtype=F64, kernels=kernels)
        return _saved_bytes(lambda: block(x))

    plain, recompute = block_bytes("torch"), block_bytes("recompute")
    scores = b * cfg.n_head * s * s * 8
    assert recompute + 2 * scores <= plain, (recompute, plain)


DRY_RECIPE = """
[model]
preset = "gpt2-tiny"
n_layer = 2
vocab_size = 300
dropout = 0.1
attn_dropout = {attn_dropout}
[parallel]
dp = 1
[train]
steps = 1
micro_batch = 2
grad_accum = 1
seq_len = 128
precision = "fp32"
[data]
source = "synthetic"
synthetic_tokens = 20000
[logging]
progress = false
[sample]
tokens = 0
[run]
dir = "{run_dir}"
"""


def _real_peak(res) -> int:
    """Peak bytes of one real (not fake) step of a world of one, measured as the dry run measures."""
    from megazoo.parallel.simulation.fake_world import fake_process_group
    from megazoo.recipes.dry_run.run import measure_step, shaped_data
    from megazoo.recipes.training.trainer import Trainer

    with fake_process_group(0, 1):  # a world of one: collectives are the identity, the tensors are real
        topo = Topology.build(1, 1, 1, device="cpu")
        return measure_step(lambda: Trainer(res, topo, shaped_data(res)), offload=False,
                            placeholders=False).peak["total"]


def test_the_dry_run_runs_it_under_attention_dropout_and_says_so(tmp_path):
    """With attention dropout the dry run swaps SDPA (whose CPU math path keeps the probabilities) for
    "recompute", notes it, and plans no scores; its fake peak is the real recomputing step's, which is lower
    than the real SDPA step's by more than the probabilities of the layers. Without dropout nothing is swapped."""
    from megazoo.recipes.dry_run.run import attention_recomputed, gpu_kernels, load, roles, run_role
    from megazoo.recipes.dry_run.report import planned, report, to_text

    path = tmp_path / "tiny.toml"
    path.write_text(DRY_RECIPE.format(attn_dropout=0.1, run_dir=tmp_path / "run"))
    res = load(path)
    swapped, notes = gpu_kernels(res)
    assert swapped.recipe.kernels.attention == "recompute" and res.recipe.kernels.attention == ""
    assert len(notes) == 1 and "recompute" in notes[0]
    plain, recompute = _real_peak(res), _real_peak(swapped)
    probs = 2 * 2 * TINY.n_head * 128 * 128 * 4  # layers x micro-batch x heads x s x s x fp32
    assert recompute + probs <= plain, (recompute, plain)
    rep = report(res, [run_role(res, roles(res)[0])], 32, 0.0)
    fake = rep["roles"][0]["measured_peak_bytes"]
    assert abs(fake - recompute) <= 0.10 * recompute, (fake, recompute)
    assert rep["notes"] == notes and f"note: {notes[0]}" in to_text(res, rep)
    row = rep["roles"][0]  # the formula counts the attention core's forward again in backward
    assert abs(row["flops"] - row["formula_flops"]) <= 0.02 * row["formula_flops"], row
    no_dropout = load(path, ["model.attn_dropout=0.0"])
    assert gpu_kernels(no_dropout) == (no_dropout, [])
    asked = load(path, ["kernels.attention=recompute"])  # the recipe's own choice: run as it is, no note
    assert gpu_kernels(asked) == (asked, []) and attention_recomputed(asked) and attention_recomputed(res)
    # The planner column: FlashAttention's bytes (no scores) for what the dry run runs, scores for the reference.
    scores = planned(load(path, ["kernels.attention=reference"]), 0)["activations"]
    assert planned(res, 0)["activations"] == planned(asked, 0)["activations"] < scores
