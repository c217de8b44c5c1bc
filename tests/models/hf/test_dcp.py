"""torch.distributed.checkpoint both ways (issue 39): a torchtitan-shaped DCP checkpoint of a tiny Llama (torchtitan's
names, q / k rows in Meta's interleaved rotary order, made here from an HF model) converts to a megazoo checkpoint
whose logits equal the HF model's, and back to DCP with every tensor identical; megazoo's own names round-trip too.
That the test's torchtitan layout is Meta's is checked independently of the converter: attention scores computed
with Meta's complex-number rotary on the torchtitan weights equal HF's rotate-half rotary on HF's weights."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import transformers

from megazoo.models.hf.families import read_hf_dir
from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.parallel.checkpoint.consolidate import CheckpointReader
from megazoo.parallel.topology import Topology
from megazoo.recipes import cli

HEADS, KV, HIDDEN, LAYERS = 4, 2, 64, 2
HD = HIDDEN // HEADS
RENAME = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
          "lm_head.weight": "output.weight"}
LAYER = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
         "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
         "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
         "post_attention_layernorm": "ffn_norm"}


def _hf():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=64, tie_word_embeddings=False,
        initializer_range=0.2)).eval()


def _to_meta(w, heads):
    """HF's convert_llama_weights_to_hf permutes Meta -> HF as view(h, hd/2, 2, d).transpose(1, 2); this undoes it."""
    return w.view(heads, 2, HD // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def torchtitan_state(hf) -> dict:
    state = {}
    for name, tensor in hf.state_dict().items():
        if name in RENAME:
            state[RENAME[name]] = tensor.clone()
            continue
        i = name.split(".")[2]  # model.layers.<i>.<module>.<weight>
        module, kind = name.split(f"model.layers.{i}.")[1].rsplit(".", 1)
        if module.endswith("q_proj"):
            tensor = _to_meta(tensor, HEADS)
        elif module.endswith("k_proj"):
            tensor = _to_meta(tensor, KV)
        state[f"layers.{i}.{LAYER[module]}.{kind}"] = tensor.clone()
    return state


def test_the_test_layout_is_metas_interleaved_rotary():
    hf = _hf()
    tt = torchtitan_state(hf)
    x, pos = torch.randn(HIDDEN, dtype=torch.float64), 7
    freqs = 1.0 / (hf.config.rope_parameters["rope_theta"] ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    angle = pos * freqs

    def meta(w, head):  # Meta / torchtitan: pairs (2i, 2i+1) as complex numbers times e^(i angle)
        q = (w.double() @ x)[head * HD:(head + 1) * HD]
        turned = torch.view_as_complex(q.view(-1, 2)) * torch.polar(torch.ones_like(angle), angle)
        return torch.view_as_real(turned).flatten()

    def half(w, head):  # HF: x * cos + rotate_half(x) * sin over halves
        q = (w.double() @ x)[head * HD:(head + 1) * HD]
        cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
        return q * cos + torch.cat([-q[HD // 2:], q[:HD // 2]]) * sin

    for head in range(HEADS):
        kv = head // (HEADS // KV)
        ours = meta(tt["layers.0.attention.wq.weight"], head) @ meta(tt["layers.0.attention.wk.weight"], kv)
        theirs = half(hf.model.layers[0].self_attn.q_proj.weight, head) @ half(
            hf.model.layers[0].self_attn.k_proj.weight, kv)
        assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)


def test_torchtitan_dcp_to_megazoo_and_back(tmp_path, capsys):
    hf = _hf()
    hf.save_pretrained(str(tmp_path / "hf"))
    state = torchtitan_state(hf)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "titan")))
    assert cli.main(["convert", "dcp-to-megazoo", str(tmp_path / "titan"), "--out", str(tmp_path / "ckpt"),
                     "--config", str(tmp_path / "hf")]) == 0
    assert "torchtitan names" in capsys.readouterr().out
    reader = CheckpointReader(tmp_path / "ckpt")
    cfg, _ = read_hf_dir(tmp_path / "hf")
    model = gpt_from_full_state(cfg, {n: reader.read(n) for n in reader.names()}, Topology.solo())
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(ids)[..., :256], hf(ids).logits, atol=1e-5, rtol=0)
    assert cli.main(["convert", "megazoo-to-dcp", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "back")))
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_megazoo_names_round_trip(tmp_path):
    _hf().save_pretrained(str(tmp_path / "hf"))
    assert cli.main(["convert", "hf-to-megazoo", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli.main(["convert", "megazoo-to-dcp", str(tmp_path / "ckpt"), "--out", str(tmp_path / "dcp"),
                     "--names", "megazoo"]) == 0
    assert cli.main(["convert", "dcp-to-megazoo", str(tmp_path / "dcp"), "--out", str(tmp_path / "again")]) == 0
    first, second = CheckpointReader(tmp_path / "ckpt"), CheckpointReader(tmp_path / "again")
    assert set(first.names()) == set(second.names())
    assert all(torch.equal(first.read(n), second.read(n)) for n in first.names())


def test_not_a_dcp_folder_is_refused(tmp_path, capsys):
    assert cli.main(["convert", "dcp-to-megazoo", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "not a torch.distributed.checkpoint folder" in capsys.readouterr().err


def _titan_run(titan: str, run_dir: str, parallel: dict, zero: dict):
    """A megazoo run whose checkpoint.load is the torchtitan DCP folder: its full weights after restore()."""
    import copy

    from recipe_helpers import TINY

    from megazoo.recipes.config import Recipe, from_dict
    from megazoo.recipes.resolve import resolve
    from megazoo.recipes.training import checkpointing
    from megazoo.recipes.training.trainer import Trainer

    table = copy.deepcopy(TINY)
    table["model"] = {"preset": "llama-tiny", "n_layer": LAYERS, "d_model": HIDDEN, "n_head": HEADS, "n_kv_head": KV,
                      "d_ff": 96, "vocab_size": 256, "n_positions": 64, "layer_norm_eps": 1e-6, "dropout": 0.0,
                      "attn_dropout": 0.0}
    table["parallel"].update(parallel)
    table["zero"] = zero
    table["train"].update(micro_batch=4 // parallel.get("dp", 1))
    table["run"] = {"dir": run_dir}
    table["checkpoint"].update(load=titan, load_optimizer=False)
    res = resolve(from_dict(Recipe, table))
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    said = []
    start = checkpointing.restore(trainer, report=said.append)
    return start, said, trainer.full_state_dict(), res.model


def test_a_torchtitan_dcp_checkpoint_loads_into_a_run(tmp_path):
    """checkpoint.load = a torchtitan DCP folder: every rank of a dp 2 x tp 2 ZeRO-3 run reads its own slices
    through the key map, and the run's model computes the HF model's logits."""
    from harness import run_distributed

    hf = _hf()
    dcp.save(torchtitan_state(hf), storage_writer=dcp.FileSystemWriter(str(tmp_path / "titan")))
    results = run_distributed(_titan_run, 4, str(tmp_path / "titan"), str(tmp_path / "run"), {"dp": 2, "tp": 2},
                              {"stage": 3})
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    for start, said, state, cfg in results:
        assert start == 0 and "torchtitan names" in said[-1]
        model = gpt_from_full_state(cfg, state, Topology.solo(), dtype=torch.float64)
        with torch.no_grad():
            assert torch.allclose(model(ids)[..., :256], hf.double()(ids).logits, atol=1e-5, rtol=0)
