"""A megazoo tokenizer written as a Hugging Face tokenizer directory, and the special ids an export records.

`save_hf_tokenizer(tokenizer, out_dir)` writes tokenizer.json + tokenizer_config.json that
`AutoTokenizer.from_pretrained(out_dir)` loads as a `PreTrainedTokenizerFast` encoding text to the same ids:

- byte-level BPE (`tokenizers` .json, megazoo's trained ones and GPT-2's BPE files): the same `tokenizers`
  pipeline, the end-of-text token `<|endoftext|>` as bos, eos, unk and pad (GPT-2's convention; pad only so that
  batched generation needs no extra setting);
- sentencepiece models trained by megazoo (lossless: identity normalisation, no dummy prefix, byte fallback):
  rebuilt as a `tokenizers` BPE / Unigram over the same pieces; the result is checked to encode probe texts to the
  ids sentencepiece gives, and refused when it does not;
- a Hugging Face tokenizer (`hf:NAME`): saved with its own save_pretrained.

`special_ids(tokenizer)` gives the bos / eos / pad ids that config.json and generation_config.json record, so
transformers' generate() stops at the model's own end-of-text.
"""

from __future__ import annotations

from pathlib import Path

from megazoo.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer
from megazoo.data.tokenizers.tokenizer import EOD_TOKEN, BPETokenizer, HFTokenizer

# Texts the rebuilt sentencepiece tokenizer must encode exactly as sentencepiece does.
_PROBES = ("Hello world", "  two  spaces\tand a tab\nnew line", "def f(x):\n    return x ** 2\n",
           "caf\u00e9 \u00fcber \u4e2d\u6587 \U0001f600", "<|endoftext|> in text")


def special_ids(tokenizer) -> dict[str, int | None]:
    """bos / eos / pad ids of an exported model: the tokenizer's end-of-text id for all three (GPT-2's
    convention), or a Hugging Face tokenizer's own."""
    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizer._backend
        eos = backend.eos_token_id
        return {"bos_token_id": backend.bos_token_id if backend.bos_token_id is not None else eos,
                "eos_token_id": eos, "pad_token_id": backend.pad_token_id if backend.pad_token_id is not None else eos}
    eod = tokenizer.eod_id
    return {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}


def _fast(backend, eod_token: str, max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=eod_token, eos_token=eod_token,
                                   unk_token=eod_token, pad_token=eod_token, model_max_length=max_length,
                                   clean_up_tokenization_spaces=False)


def _sentencepiece_backend(tokenizer: SentencePieceTokenizer):
    """A `tokenizers` pipeline over the sentencepiece model's pieces (BPE merges or unigram scores)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
    from transformers.tokenization_utils_base import generate_merges

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(tokenizer._sp.serialized_model_proto())
    vocab_scores = [(p.piece, p.score) for p in proto.pieces]
    if proto.trainer_spec.model_type == 2:  # BPE: merges recovered from the pieces and their order
        vocab = {piece: i for i, (piece, _) in enumerate(vocab_scores)}
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, generate_merges(vocab))
    else:
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab_scores)
    if backend is None:
        raise ValueError(f"sentencepiece model {tokenizer.source}: unsupported model type for export")
    # control (3) and user-defined (4) pieces are matched before the model, as sentencepiece does
    backend.add_tokens([AddedToken(p.piece, normalized=False, special=p.type == 3)
                        for p in proto.pieces if p.type in (3, 4)])
    return backend


def _check_same_ids(tokenizer, hf_tokenizer, what: str) -> None:
    for probe in _PROBES:
        ours = tokenizer.encode(probe)
        theirs = hf_tokenizer.encode(probe, add_special_tokens=False)
        if EOD_TOKEN in probe:  # a literal end-of-text mark is special text to transformers (as for GPT-2)
            continue
        if ours != theirs:
            raise ValueError(f"{what} cannot be exported as a Hugging Face tokenizer with the same ids: "
                             f"{probe!r} encodes to {ours[:12]} here and {theirs[:12]} there; export without "
                             "it (--tokenizer none) and ship the tokenizer file beside the model")


def save_hf_tokenizer(tokenizer, out_dir: str | Path, max_length: int) -> None:
    """Write `tokenizer` into `out_dir` so that AutoTokenizer.from_pretrained(out_dir) loads it."""
    import tokenizers

    out_dir = Path(out_dir)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer._backend.save_pretrained(str(out_dir))
        return
    if isinstance(tokenizer, BPETokenizer):
        backend = tokenizers.Tokenizer.from_str(tokenizer.to_json())  # a copy: the caller's flags stay
        hf = _fast(backend, EOD_TOKEN, max_length)
        _check_same_ids(tokenizer, hf, "this BPE tokenizer")
    elif isinstance(tokenizer, SentencePieceTokenizer):
        eod_piece = tokenizer._sp.id_to_piece(tokenizer.eod_id)
        hf = _fast(_sentencepiece_backend(tokenizer), eod_piece, max_length)
        _check_same_ids(tokenizer, hf, f"sentencepiece model {tokenizer.source}")
    else:
        raise ValueError(f"cannot export a tokenizer of type {type(tokenizer).__name__}")
    hf.save_pretrained(str(out_dir))
    _name_a_class_every_transformers_loads(out_dir / "tokenizer_config.json")


# The built-in chat templates (data/sft/chat_template.py: BUILTIN_TEMPLATES) in the Jinja transformers'
# apply_chat_template renders: the same text for every conversation (tests/models/hf/test_sft_export.py).
JINJA_TEMPLATES = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}"),
    "llama3": ("{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
               "{% endif %}"),
}


def jinja_template(name: str) -> str:
    if name not in JINJA_TEMPLATES:
        raise ValueError(f"chat template {name!r} has no Jinja form for export; valid: {', '.join(JINJA_TEMPLATES)}")
    return JINJA_TEMPLATES[name]


# transformers 5 saves a fast tokenizer as "TokenizersBackend", a class transformers 4.x does not have (the
# project declares transformers>=4.40); "PreTrainedTokenizerFast" is the same class in 5.x (an alias) and the
# class 4.x writes, so both majors load the exported directory (tests/models/test_export_tokenizer.py, on both).
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _name_a_class_every_transformers_loads(config_path: Path) -> None:
    import json

    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
