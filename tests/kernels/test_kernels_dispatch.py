"""The kernel dispatch: choices, clear errors, the run-log lines; the model through it at tp 1 and 2; training
the demo model with prefer = "triton" (interpreted on CPU) gives the losses of prefer = "reference"."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before kernels/triton_*.py are imported: Triton fixes the mode at @jit

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from harness import run_distributed  # noqa: E402

from megazoo.kernels import OPS, KernelChoice, KernelError, implementations, model_defaults, resolve_kernels  # noqa: E402
from megazoo.kernels.dispatch import resolve_op  # noqa: E402
from megazoo.kernels.availability import module_exists  # noqa: E402
from megazoo.models.presets import get_preset  # noqa: E402
from megazoo.models.transformer import GPT  # noqa: E402
from megazoo.models.weights import init_weights  # noqa: E402
from megazoo.parallel.tensor import gather_from_tp_region, gather_full, named_shards  # noqa: E402
from megazoo.parallel.topology import Topology  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed: pip install 'megazoo[kernels]'")
CPU = torch.device("cpu")


# --- choices and errors ---------------------------------------------------------------------------------------

def test_every_op_has_a_reference_and_lists_its_implementations():
    assert OPS == ("layer_norm", "bias_gelu", "attention", "cross_entropy", "adamw")
    for op in OPS:
        assert implementations(op)[-1] == "reference"
    assert implementations("adamw") == ("apex", "torch", "foreach", "reference")


@pytest.mark.parametrize("kwargs, words", [
    ({"prefer": "fastest"}, ["kernels.prefer", "'fastest'", "'auto'", "'triton'", "'reference'"]),
    ({"overrides": {"softmax": "triton"}}, ["kernels.softmax", "not a kernel op", "layer_norm", "adamw"]),
    ({"overrides": {"bias_gelu": "apex"}}, ["kernels.bias_gelu", "'apex'", "'triton'", "'torch'", "'reference'"]),
    ({"overrides": {"layer_norm": "foreach"}}, ["kernels.layer_norm", "'foreach'", "'apex'"]),
])
def test_invalid_choices_name_the_op_the_value_and_what_is_valid(kwargs, words):
    with pytest.raises(KernelError) as err:
        KernelChoice(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_choice_is_frozen():
    overrides = {"attention": "reference"}
    choice = KernelChoice("torch", overrides)
    overrides["attention"] = "torch"
    assert choice.overrides["attention"] == "reference"
    with pytest.raises(TypeError):
        choice.overrides["layer_norm"] = "torch"


@pytest.mark.skipif(module_exists("apex"), reason="apex is installed here")
@pytest.mark.parametrize("choice", [KernelChoice("apex"), KernelChoice(overrides={"layer_norm": "apex"}),
                                    KernelChoice(overrides={"adamw": "apex"})])
def test_asking_for_apex_without_it_fails_saying_how_to_install_it(choice):
    with pytest.raises(KernelError) as err:
        resolve_kernels(choice, CPU)
    message = str(err.value)
    for words in ("apex is not installed", "not on PyPI", "git clone https://github.com/NVIDIA/apex",
                  "--cuda_ext", "--cpp_ext", "--no-build-isolation", "run here: "):
        assert words in message, message


def test_auto_on_cpu_picks_torch_and_never_interpreted_triton():
    kernels = resolve_kernels(KernelChoice("auto"), CPU)
    assert {op: k.name for op, k in kernels.items()} == {op: "torch" for op in OPS}
    if HAVE_TRITON:  # runnable here (interpreted), but auto leaves it to tests (cross_entropy: Triton before torch)
        assert "triton: interpreted" in kernels["cross_entropy"].why


@needs_triton
def test_prefer_picks_per_op_with_overrides_winning_and_auto_where_a_family_has_no_op():
    kernels = resolve_kernels(KernelChoice("triton", {"attention": "reference"}), CPU)
    assert {op: k.name for op, k in kernels.items()} == {
        "layer_norm": "triton", "bias_gelu": "triton", "attention": "reference", "cross_entropy": "triton",
        "adamw": "torch"}
    assert kernels["adamw"].why.startswith("auto: no triton implementation of adamw")
    assert kernels["attention"].why == "kernels.attention = 'reference'"
    assert kernels["layer_norm"].why == "kernels.prefer = 'triton'"


def test_describe_gives_one_log_line_per_op():
    kernels = resolve_kernels(KernelChoice("reference", {"adamw": "foreach"}), CPU)
    lines = kernels.describe()
    assert len(lines) == len(OPS)
    for line, op in zip(lines, OPS):
        impl = "foreach" if op == "adamw" else "reference"
        assert line.startswith("kernels: ") and f"{op} " in line and f"= {impl} " in line


@needs_triton
def test_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from megazoo.kernels import KernelChoice, KernelError, resolve_kernels\n"
            "try:\n    resolve_kernels(KernelChoice(overrides={'cross_entropy': 'triton'}), 'cpu')\n"
            "except KernelError as e:\n    print(e)\nelse:\n    print('resolved')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert "kernels.cross_entropy = 'triton'" in out.stdout, out.stdout + out.stderr
    assert "CUDA only" in out.stdout and "TRITON_INTERPRET=1" in out.stdout
    assert "that run here: torch, reference" in out.stdout


# --- the model through the dispatch ---------------------------------------------------------------------------

CFG = get_preset("gpt2-tiny").replace(vocab_size=300, dropout=0.0, attn_dropout=0.0, n_layer=2)


def _batch(vocab, b=2, s=17, seed=0):
    ids = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    targets = ids[:, 1:].clone()
    targets[1, 4] = -100
    return ids[:, :-1], targets


def _run(topo, cfg, choice, seed=7):
    model = GPT(cfg, topo, kernels=choice)
    init_weights(model, seed)
    inputs, targets = _batch(cfg.vocab_size)
    logits = model(inputs)
    loss = model.loss(logits, targets)
    loss.backward()
    grads = {name: gather_full(p.grad, spec, topo.tp_group) for name, p, spec in named_shards(model)}
    grads["wte.weight"] = grads["wte.weight"][:cfg.vocab_size]  # the padded vocabulary depends on tp
    full_logits = gather_from_tp_region(logits.detach(), topo.tp_group)[..., :cfg.vocab_size]
    return full_logits, loss.detach(), grads, [k.name for k in model.kernels.values()]


def test_default_model_kernels_are_the_pre_dispatch_ops():
    model = GPT(CFG, Topology.solo())
    assert {op: k.name for op, k in model.kernels.items()} == {
        "layer_norm": "torch", "bias_gelu": "torch", "attention": "torch", "cross_entropy": "reference",
        "adamw": "reference"}
    assert model.h["0"].mlp.bias_gelu is None  # c_fc adds its bias in the GEMM, exactly as before
    assert {op: k.name for op, k in model.kernels.items()} == {op: k.name for op, k in model_defaults().items()}


def _assert_same_model(got, ref, rtol):
    logits, loss, grads, _ = got
    torch.testing.assert_close(logits, ref[0], rtol=rtol, atol=rtol * ref[0].abs().max().item())
    torch.testing.assert_close(loss, ref[1], rtol=rtol, atol=0)
    assert grads.keys() == ref[2].keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[2][name], rtol=rtol, atol=rtol * ref[2][name].abs().max().item(), msg=name)


@pytest.mark.parametrize("prefer", ["reference", "torch", pytest.param("triton", marks=needs_triton)])
def test_model_with_each_preference_computes_the_default_models_function(prefer):
    solo = Topology.solo()
    ref = _run(solo, CFG, None)
    got = _run(solo, CFG, KernelChoice(prefer))
    assert set(got[3]) <= {prefer, "torch"}  # torch where the family lacks the op (adamw under triton)
    # Same parameters, names and shapes whatever the kernels (checkpoints and HF conversion depend on it).
    names = {n: tuple(p.shape) for n, p, _ in named_shards(GPT(CFG, solo, kernels=KernelChoice(prefer)))}
    assert names == {n: tuple(p.shape) for n, p, _ in named_shards(GPT(CFG, solo))}
    _assert_same_model(got, ref, rtol=1e-5)


@pytest.mark.parametrize("prefer", ["reference", pytest.param("triton", marks=needs_triton)])
def test_model_at_tp2_with_fused_kernels_equals_the_solo_default(prefer):
    """tp = 2: the fused bias-GELU after a bias-less column-parallel c_fc, the vocab-parallel cross-entropy."""
    ref = _run(Topology.solo(), CFG, None)
    choice = KernelChoice(prefer, {"cross_entropy": "torch"} if prefer == "reference" else {})
    for got in run_distributed(lambda: _run(Topology.build(dp=1, tp=2), CFG, choice), 2):
        _assert_same_model(got, ref, rtol=1e-5)


# --- training the demo model ----------------------------------------------------------------------------------

DEMO = get_preset("gpt2-tiny").replace(vocab_size=4096, dropout=0.0, attn_dropout=0.0)  # recipes/demo.toml's model


def _train(choice: KernelChoice, steps=3, seed=1234):
    torch.manual_seed(seed)
    kernels = resolve_kernels(choice, CPU)
    model = GPT(DEMO, Topology.solo(), kernels=kernels)
    init_weights(model, seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = kernels["adamw"].fn([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=2e-3, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    inputs, targets = _batch(DEMO.vocab_size, b=2, s=32)  # one batch, learnt a little more each step
    for _ in range(steps):
        loss = model.loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [k.name for k in kernels.values()]


@needs_triton
def test_training_with_triton_gives_the_losses_of_reference():
    ref, ref_names = _train(KernelChoice("reference"))
    got, names = _train(KernelChoice("triton", {"attention": "triton"}))  # prefer alone keeps SDPA (below)
    assert ref_names == ["reference"] * len(OPS)
    assert names == ["triton", "triton", "triton", "triton", "torch"]  # no Triton AdamW: auto gives torch fused
    assert ref[-1] < ref[0], "the demo model learns"
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)


@pytest.mark.parametrize("prefer", ["apex", "triton"])
def test_prefer_never_swaps_sdpa_for_an_attention_that_holds_the_scores(prefer):
    """The apex and Triton attentions materialise the (b, h, s, s) scores: a family preference keeps SDPA;
    only kernels.attention picks them."""
    chosen = resolve_op("attention", KernelChoice(prefer), CPU)
    assert chosen.name == "torch" and chosen.why.startswith(f"auto: prefer does not pick the {prefer} attention")


def test_kernels_are_chosen_for_the_dtype_and_the_optimizer_device():
    """Triton kernels take fp32/bf16/fp16: an fp64 model gets torch's; AdamW is chosen where its states live."""
    with pytest.raises(KernelError, match="cannot run on cpu for float64: it takes float32, bfloat16, float16"):
        resolve_kernels(KernelChoice(overrides={"layer_norm": "triton"}), CPU, torch.float64)
    auto = resolve_kernels(KernelChoice("auto"), CPU, torch.float64)
    assert auto["layer_norm"].name == "torch"
    chosen = resolve_kernels(KernelChoice("auto"), "meta", torch.bfloat16, optimizer_device=CPU,
                             optimizer_dtype=torch.float32)
    assert chosen["adamw"].name == "torch" and chosen["layer_norm"].name in ("torch", "reference")
