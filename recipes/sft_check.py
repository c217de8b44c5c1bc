"""The resolver's check of a recipe's `[sft]` section (recipes/sft_section.py) against its dataset and layout."""

from __future__ import annotations

import json
from pathlib import Path

from megazoo.recipes.config import RecipeError
from megazoo.recipes.sft_section import SFTSection


def _manifest(key: str, prefix: str) -> dict:
    path = Path(prefix + ".sft.json")
    if not path.is_file():
        raise RecipeError(f"{key} = {prefix!r}: no SFT dataset there ({path} is missing); write one with "
                          "`megazoo preprocess --format sft --output-prefix PREFIX ...`")
    return json.loads(path.read_text())


def check_sft(sft: SFTSection, *, seq_len: int, vocab_size: int, cp: int, attention: str,
              mtp_depth: int = 0) -> None:
    """RecipeError naming the field for an [sft] section that cannot run with this recipe."""
    if not sft.path:
        if sft.valid_path:
            raise RecipeError(f"sft.valid_path = {sft.valid_path!r} is set but sft.path is empty; valid: set sft.path "
                              "too, or leave both empty")
        return
    for key, prefix in (("sft.path", sft.path), ("sft.valid_path", sft.valid_path)):
        if not prefix:
            continue
        manifest = _manifest(key, prefix)
        if manifest["seq_len"] > seq_len:
            raise RecipeError(f"{key} = {prefix!r} holds examples of up to {manifest['seq_len']} tokens (its "
                              f"--seq-len), more than train.seq_len = {seq_len}; valid: train.seq_len >= "
                              f"{manifest['seq_len']}, or rebuild the dataset with --seq-len {seq_len}")
        if manifest["vocab_size"] > vocab_size:
            raise RecipeError(f"{key} = {prefix!r} was tokenized with {manifest['vocab_size']} ids but "
                              f"model.vocab_size = {vocab_size}; valid: model.vocab_size >= {manifest['vocab_size']}")
    if sft.packing and cp > 1:
        raise RecipeError(f"sft.packing = true with parallel.cp = {cp} is not supported yet; valid: parallel.cp = 1 "
                          "or sft.packing = false")
    if sft.packing and attention != "dense":
        raise RecipeError(f"sft.packing = true needs model.attention = 'dense', got {attention!r}; or set "
                          "sft.packing = false")
    if sft.packing and mtp_depth:  # its shifted targets and its block would cross from one example into the next
        raise RecipeError(f"sft.packing = true with multi-token prediction (model.mtp_depth = {mtp_depth}) is not "
                          "supported; valid: model.mtp_depth = 0 for packed fine-tuning, or sft.packing = false")
