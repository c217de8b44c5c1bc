"""`megazoo convert` both ways for the MoE families: an HF Mixtral / Qwen3-MoE / Qwen2-MoE / Qwen3 directory (as
transformers saves it, with a tokenizer) -> megazoo checkpoint -> HF directory that transformers loads as the same
class, with the same logits; the checkpoint records the MoE fields. The fp64 check `--verify` runs reads the MoE
directory with transformers' per-expert loop (its grouped matmul refuses fp64 on CPU).

Not `--verify` itself: its 1e-10 fp64 tolerance fails for every RMSNorm family, Llama's included, because
transformers' RMSNorm computes in fp32 even in an fp64 model (5.9e-8 on a tiny Llama, 7.4e-8 on a tiny Mixtral)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from megazoo.models.hf.convert_verify import hf_dir_logits_fn
from megazoo.recipes import cli

V = 300
COMMON = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, num_hidden_layers=2)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                                     num_experts=4, num_experts_per_tok=2, head_dim=32,
                                                     norm_topk_prob=True, mlp_only_layers=[0]),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48, num_experts=4,
                                                     num_experts_per_tok=2),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, intermediate_size=96, head_dim=32),
}
IDS = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(1))


def tiny_tokenizer():
    """A byte-level BPE of fewer than V ids with bos / eos, as an HF fast tokenizer (trained here, no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def main():\n    return tokens\n", "the quick brown fox jumps"] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_convert_both_ways(family, tmp_path, capsys):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "gate" in name:
                p.add_(torch.randn_like(p) * 0.3)
    source, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    model.save_pretrained(str(source))
    tiny_tokenizer().save_pretrained(str(source))
    assert cli.main(["convert", "hf-to-megazoo", str(source), "--out", str(ckpt)]) == 0
    assert f"converted HF {family}" in capsys.readouterr().out
    (common,) = ckpt.rglob("common.json")
    recorded = json.loads(common.read_text())["model"]
    assert recorded["n_experts"] == (0 if family == "qwen3" else 4) and recorded["qk_norm"] == family.startswith("qwen3")
    assert cli.main(["convert", "megazoo-to-hf", str(ckpt), "--out", str(back)]) == 0
    assert "with its tokenizer" in capsys.readouterr().out
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert (reloaded(IDS).logits - model(IDS).logits).abs().max().item() < 1e-5
    fp64 = hf_dir_logits_fn(back)(IDS)  # what --verify compares: transformers in fp64
    assert fp64.dtype == torch.float64 and (fp64 - model(IDS).logits.double()).abs().max().item() < 1e-5
