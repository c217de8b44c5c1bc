"""A tokenizer as plain data, so a checkpoint carries the tokenizer its model was trained with.

`tokenizer_record(tokenizer)` -> a JSON-able dict (common.json of a training checkpoint holds it under
"tokenizer"); `tokenizer_from_record(record)` turns it back into the same tokenizer, with the same ids:

- a `tokenizers` BPE (trained by megazoo, e.g. the demo's) or GPT-2's BPE files: the tokenizers JSON text;
- a sentencepiece model: its serialized model proto, base64;
- a Hugging Face tokenizer (`hf:NAME`): its name or directory (the files themselves stay where they are).

`checkpoint_tokenizer(common, checkpoint)` is what eval, export and generate call: the record when the checkpoint
has one, else (checkpoints written before records existed) the recipe's `data.tokenizer`, or the demo corpus's
cached tokenizer in the run directory (`run.dir/data_cache/stdlib-.../tokenizer.json`); None when neither exists.
"""

from __future__ import annotations

import base64
from pathlib import Path

import tokenizers

from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer
from megazoo.data.tokenizers.tokenizer import HF_PREFIX, BPETokenizer, HFTokenizer, Tokenizer

KINDS = ("tokenizers-bpe", "gpt2-bpe", "sentencepiece", "hf")


def tokenizer_record(tokenizer: Tokenizer) -> dict:
    """The tokenizer as plain data (see the module docstring); raises for a kind it cannot describe."""
    if isinstance(tokenizer, BPETokenizer):  # GPT2BPETokenizer is one too (its eod is a vocabulary entry)
        kind = "gpt2-bpe" if isinstance(tokenizer, GPT2BPETokenizer) else "tokenizers-bpe"
        return {"kind": kind, "json": tokenizer.to_json(), "vocab_size": tokenizer.vocab_size}
    if isinstance(tokenizer, SentencePieceTokenizer):
        proto = tokenizer._sp.serialized_model_proto()
        return {"kind": "sentencepiece", "model_base64": base64.b64encode(proto).decode("ascii"),
                "vocab_size": tokenizer.vocab_size}
    if isinstance(tokenizer, HFTokenizer):
        return {"kind": "hf", "source": tokenizer.source, "vocab_size": tokenizer.vocab_size}
    raise ValueError(f"cannot record a tokenizer of type {type(tokenizer).__name__}: expected one of {KINDS}")


def tokenizer_from_record(record: dict, where: str = "checkpoint") -> Tokenizer:
    """The tokenizer a record describes; errors name `where` the record came from."""
    kind = record.get("kind") if isinstance(record, dict) else None
    try:
        if kind in ("tokenizers-bpe", "gpt2-bpe"):
            cls = GPT2BPETokenizer if kind == "gpt2-bpe" else BPETokenizer
            tokenizer = cls(tokenizers.Tokenizer.from_str(record["json"]), source=f"{where} (tokenizer record)")
        elif kind == "sentencepiece":
            tokenizer = SentencePieceTokenizer.from_bytes(base64.b64decode(record["model_base64"]),
                                                          source=f"{where} (tokenizer record)")
        elif kind == "hf":
            from megazoo.data.tokenizers.loading import load_tokenizer

            source = record["source"]
            tokenizer = load_tokenizer(source if source.startswith(HF_PREFIX) else HF_PREFIX + source)
        else:
            raise ValueError(f"unknown kind {kind!r} (valid: {', '.join(KINDS)})")
    except (FileNotFoundError, ConnectionError):  # an hf: tokenizer that is not here: the loader's message
        raise
    except Exception as error:  # noqa: BLE001 - tokenizers / sentencepiece raise bare exceptions for bad data
        raise ValueError(f"the tokenizer stored in {where} cannot be read: {error}") from error
    if "vocab_size" in record and tokenizer.vocab_size != record["vocab_size"]:
        raise ValueError(f"the tokenizer stored in {where} has {tokenizer.vocab_size} ids, its record says "
                         f"{record['vocab_size']}: the record is corrupt")
    return tokenizer


def checkpoint_tokenizer(common: dict, checkpoint: str | Path) -> Tokenizer | None:
    """The tokenizer a checkpoint's model was trained with (common: its common.json), or None if unknown."""
    from megazoo.data.tokenizers.loading import load_tokenizer

    checkpoint = Path(checkpoint)
    if common.get("tokenizer"):
        return tokenizer_from_record(common["tokenizer"], where=f"checkpoint {checkpoint}")
    data = (common.get("recipe") or {}).get("data") or {}
    if data.get("source") == "indexed" and data.get("tokenizer"):
        return load_tokenizer(data["tokenizer"])
    if data.get("source", "stdlib") == "stdlib" and "vocab_size" in data:
        # The demo corpus's tokenizer, cached in the run directory (run.dir/checkpoints/step_N is the checkpoint).
        pattern = (f"stdlib-py*-v{data['vocab_size']}-b{data.get('max_bytes')}-val{data.get('val_fraction')!r}-s0"
                   "/tokenizer.json")
        found = sorted((checkpoint.parent.parent / "data_cache").glob(pattern))
        if found:
            return BPETokenizer.load(found[-1])
    return None
