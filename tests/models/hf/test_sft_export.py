"""An SFT run's HF export (issue 37): tokenizer_config.json carries the chat template the run's dataset was rendered
with, so transformers' apply_chat_template gives the text training saw, and the template's end-of-turn marker is
the stop: the eos token when the tokenizer holds it as one token (tokenizer_config, config.json, and
generation_config.json's eos list beside end-of-text), else generation_config's stop_strings; HF generate then
stops at `<|im_end|>`. A run that was not SFT exports no template."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from megazoo.data.sft.chat_template import BUILTIN_TEMPLATES
from megazoo.data.sft.dataset import MANIFEST_SUFFIX
from megazoo.data.tokenizers.tokenizer import BPETokenizer, HFTokenizer
from megazoo.models.config import ModelConfig
from megazoo.models.hf.convert_lora import chat_export
from megazoo.models.hf.llama import export_hf_dir
from megazoo.models.layout import parameter_layout

CHAT = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " Four."}, {"role": "user", "content": "And 3+3?"}]


def _bpe(specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def main():\n    return tokens\n", "the quick brown fox jumps"] * 20, trainer)
    return tok


def _tokenizer(kind: str):
    if kind == "special":  # <|im_end|> is one token of the vocabulary (as in Qwen's)
        backend = transformers.PreTrainedTokenizerFast(
            tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), eos_token="<|endoftext|>")
        return HFTokenizer(backend)
    return BPETokenizer(_bpe(["<|endoftext|>"]))  # the marker is several BPE tokens


def _export(tmp_path, tokenizer, template: str | None):
    cfg = ModelConfig(name="tiny-sft", n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32, n_positions=128,
                      vocab_size=320, norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False)
    torch.manual_seed(0)
    state = {p.name: torch.randn(p.shape) * 0.1 for p in parameter_layout(cfg, vocab=cfg.vocab_size)}
    out = tmp_path / "hf"
    export_hf_dir(state, cfg, out, tokenizer=tokenizer)
    common = {"recipe": None}
    if template is not None:
        prefix = tmp_path / "sft" / "data"
        prefix.parent.mkdir()
        (tmp_path / "sft" / ("data" + MANIFEST_SUFFIX)).write_text(json.dumps({"template": template}))
        common = {"recipe": {"sft": {"path": str(prefix)}}}
    return out, chat_export(out, common, tokenizer)


@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
def test_exported_template_renders_as_training_did(tmp_path, template):
    out, name = _export(tmp_path, _tokenizer("special"), template)
    assert name == template
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    for prompt in (False, True):
        assert hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == \
            BUILTIN_TEMPLATES[template](CHAT, prompt)


def test_single_token_marker_is_the_eos_and_generate_stops_there(tmp_path):
    tokenizer = _tokenizer("special")
    out, _ = _export(tmp_path, tokenizer, "chatml")
    im_end = tokenizer._backend.convert_tokens_to_ids("<|im_end|>")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.eos_token_id == im_end
    assert generation.eos_token_id == [im_end, tokenizer.eod_id]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == im_end
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    def says_im_end(module, inputs, logits):  # a head that always says <|im_end|>: generate stops after one token
        logits[..., im_end] = 1e4
        return logits

    model.lm_head.register_forward_hook(says_im_end)
    with torch.no_grad():
        ids = hf_tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        generated = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert generated[0, ids["input_ids"].shape[1]:].tolist() == [im_end]


def test_multi_token_marker_becomes_a_stop_string(tmp_path):
    out, _ = _export(tmp_path, _tokenizer("bpe"), "chatml")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["stop_strings"] == ["<|im_end|>"]
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_a_run_without_sft_exports_no_template(tmp_path):
    out, name = _export(tmp_path, _tokenizer("special"), None)
    assert name is None and "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
