"""`megazoo convert hf-to-megazoo HF_DIR --out DIR` and `megazoo convert megazoo-to-hf CKPT --out DIR`.

GPT-2 directories convert through models/hf/gpt2.py, LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM
ones (config.json's model_type) through models/hf/llama.py; an export picks the family the checkpoint's model
config computes (GPT-2's block, or models/hf/llama.py's hf_family).

megazoo checkpoints are the sharded, topology-independent ones of parallel/checkpoint: hf-to-megazoo writes a
one-rank checkpoint (a checkpoints folder holding step_00000000) that loads into any layout, e.g. as
`[checkpoint] load` of a fine-tuning recipe; megazoo-to-hf consolidates a checkpoint of any layout (ZeRO-3
included) into full tensors and writes a directory `transformers` loads. Sizes and sha256 in the manifest (itself
checked against manifest.sha256) detect truncated or corrupt files before anything is read; the model config
comes from common.json and tensors are read with torch.load(weights_only=True), so a checkpoint never runs code.

megazoo-to-hf also writes the model's tokenizer (--tokenizer, else the one the checkpoint records) as a Hugging
Face tokenizer, and its end-of-text id as bos / eos / pad in config.json and generation_config.json, so
AutoTokenizer loads the directory and generate() stops at end-of-text (models/hf/tokenizer_export.py). Both
directions write into a temporary directory beside --out and rename it at the end: a failed or interrupted
conversion leaves nothing half-written, and an existing non-empty --out is refused before anything is read.
With --verify the result is published only once it scores the same as its source (models/hf/convert_verify.py:
logits and loss of a fixed sample, fp64, and a WikiText / LAMBADA slice scored both ways, models/gpt2/
convert_slices.py, when the data is found: --verify-data, else $MEGAZOO_DATA_DIR, else the cache); otherwise
exit 1 and nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

from megazoo.models.config import ModelConfig

if TYPE_CHECKING:  # torch and the checkpoint modules load when a conversion runs, not for `megazoo convert --help`
    import torch


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse an existing non-empty `out_dir` (or a file there), so no earlier result is ever overwritten."""
    from megazoo.parallel.checkpoint.io import CheckpointError

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"output directory {out_dir} exists and is not empty: choose a new --out "
                              "(nothing is overwritten)")
    return out_dir


def ensure_empty_out_dir(out_dir: str | Path) -> Path:
    """`out_dir`, created if needed; refuses a non-empty one so no earlier result is ever overwritten."""
    out_dir = check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def _plain_modes(folder: Path) -> None:
    """Give `folder` and everything in it the modes a plain mkdir / open would under the user's umask:
    mkdtemp makes the folder 0700 and safetensors writes its file 0600, which shared storage cannot read."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def staged_out_dir(out_dir: str | Path):
    """Yield a fresh temporary directory beside `out_dir`, renamed to `out_dir` only when the block succeeds:
    an interrupted or failed conversion leaves no half-written output (the temporary one is removed)."""
    out_dir = check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield staging
        _plain_modes(staging)
        check_out_dir(out_dir)  # nobody wrote there meanwhile
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked): replaced by the finished one
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_consolidated(full_state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write full weights as a megazoo checkpoint folder `out_dir` (which must be empty or absent)."""
    from megazoo.parallel.checkpoint.consolidate import write_full_checkpoint

    out_dir = ensure_empty_out_dir(out_dir)
    write_full_checkpoint(full_state, dataclasses.asdict(cfg), out_dir)
    return out_dir


def load_consolidated_config(ckpt_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint (cheap: the weights are not read)."""
    from megazoo.parallel.checkpoint.consolidate import read_common, resolve_checkpoint

    return _model_config(read_common(resolve_checkpoint(ckpt_dir)))


def load_consolidated(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full fp32 state) of a checkpoint of any layout, after verifying every file."""
    from megazoo.parallel.checkpoint.consolidate import read_full_state

    model, state = read_full_state(ckpt_dir)
    return _model_config({"model": model}), state


def _model_config(common: dict) -> ModelConfig:
    from megazoo.parallel.checkpoint.io import CheckpointError

    try:
        return ModelConfig(**common["model"])
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint model config is corrupt: {error!r}") from error


def hf_model_type(hf_dir: str | Path) -> str:
    """config.json's model_type ("gpt2", "llama", "qwen2", "mistral", ...), read without transformers."""
    config = Path(hf_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"HF checkpoint directory {hf_dir} has no config.json")
    try:
        return str(json.loads(config.read_text())["model_type"])
    except (ValueError, KeyError) as error:
        raise ValueError(f"cannot read model_type from HF config {config}: {error!r}") from error


def _hf_to_megazoo(args: argparse.Namespace) -> int:
    from megazoo.parallel.checkpoint.consolidate import write_full_checkpoint
    from megazoo.models.hf.llama import FAMILIES
    from megazoo.models.hf.moe_families import FAMILIES as MOE_FAMILIES

    check_out_dir(args.out)  # checked before the (slow) read
    slices = _verify_data(args)
    model_type = hf_model_type(args.hf_dir)
    if model_type == "gpt2":
        from megazoo.models.hf.gpt2 import read_hf_dir
    elif model_type in FAMILIES:
        from megazoo.models.hf.llama import read_hf_dir
    elif model_type in MOE_FAMILIES:  # Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3
        from megazoo.models.hf.moe_families import read_hf_dir
    else:
        raise ValueError(f"{args.hf_dir}: HF model_type {model_type!r} cannot be converted; valid: gpt2, "
                         f"{', '.join(FAMILIES)}, {', '.join(MOE_FAMILIES)}")
    cfg, full_state = read_hf_dir(args.hf_dir)
    tokenizer = _hf_tokenizer_files(args.hf_dir) if model_type != "gpt2" else []
    try:
        with staged_out_dir(args.out) as staging:
            record = None
            if tokenizer:  # the checkpoint keeps its own copy; the record names where it will be after the rename
                from megazoo.data.tokenizers.loading import load_hf_tokenizer
                from megazoo.data.tokenizers.store import tokenizer_record

                (staging / HF_TOKENIZER_DIR).mkdir()
                for file in tokenizer:
                    shutil.copyfile(file, staging / HF_TOKENIZER_DIR / file.name)
                record = tokenizer_record(load_hf_tokenizer(str(staging / HF_TOKENIZER_DIR)))
                record["source"] = str(Path(args.out).resolve() / HF_TOKENIZER_DIR)
            write_full_checkpoint(full_state, dataclasses.asdict(cfg), staging, tokenizer=record)
            if args.verify:  # the checkpoint as written, read back, against the HF source
                _verified(*load_consolidated(staging), args.hf_dir, slices)
    except ConversionRefused as refused:
        print(f"megazoo: convert hf-to-megazoo: {refused}", file=sys.stderr)
        return 1
    what = "with its tokenizer" if tokenizer else "without a tokenizer (none in the HF directory)"
    print(f"converted HF {model_type} {args.hf_dir} ({cfg.num_parameters():,} parameters) to megazoo checkpoint "
          f"{args.out}, {what}")
    return 0


class ConversionRefused(Exception):
    """--verify: the converted model does not score as its source; nothing is written to --out."""


def _verify_data(args: argparse.Namespace):
    """--verify's WikiText / LAMBADA slices (convert_slices.SliceData), read before any conversion work; None (and
    one line saying so) when no data folder holds them. A given --verify-data without them is bad input."""
    if not args.verify:
        return None
    from megazoo.data.published.catalog import default_folders
    from megazoo.models.hf.convert_slices import find_slice_data, load_slices

    looked = [Path(args.verify_data)] if args.verify_data else default_folders(os.environ)
    folder = find_slice_data(looked)
    if folder is None and args.verify_data:
        raise FileNotFoundError(f"--verify-data {args.verify_data} lacks wikitext103/, lambada/ or gpt2_bpe/ (the "
                                f"layout `megazoo data fetch all --dir {args.verify_data}` writes)")
    if folder is None:
        print(f"verify: no WikiText / LAMBADA data in {', '.join(map(str, looked))} (--verify-data DIR, "
              "$MEGAZOO_DATA_DIR, the cache; `megazoo data fetch all`): scoring the fixed sample only")
        return None
    return load_slices(folder, args.verify_tokens, args.verify_lambada)


def _verified(cfg: ModelConfig, full_state: dict[str, torch.Tensor], hf_dir: str | Path, slices=None) -> None:
    from megazoo.models.hf.convert_slices import GPT2_VOCAB
    from megazoo.models.hf.convert_verify import check_export

    if slices is not None and cfg.vocab_size < GPT2_VOCAB:
        print(f"verify: the model's vocabulary ({cfg.vocab_size:,}) is smaller than GPT-2 BPE's {GPT2_VOCAB:,}: the "
              "WikiText / LAMBADA slices are not scored, the fixed sample only")
        slices = None
    check = check_export(cfg, full_state, hf_dir, slices)
    print(check.table())
    if not check.passed:
        raise ConversionRefused("the converted model does not score as its source (tables above): refused, "
                                "nothing written to --out")

# A Llama-family conversion copies the HF tokenizer here (beside the checkpoints' step directories).
HF_TOKENIZER_DIR = "hf_tokenizer"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _hf_tokenizer_files(hf_dir: str | Path) -> list[Path]:
    """The tokenizer files of an HF directory (none when it ships no tokenizer)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file() and not (hf_dir / "tokenizer.model").is_file():
        return []
    return [hf_dir / name for name in _TOKENIZER_FILES if (hf_dir / name).is_file()]


def export_tokenizer(checkpoint: str | Path, spec: str | None):
    """The tokenizer an export writes: --tokenizer (a spec, or "none"), else the one the checkpoint records."""
    from megazoo.models.loading import open_checkpoint

    if spec == "none":
        return None
    return open_checkpoint(checkpoint, spec, need_tokenizer=False, report=lambda message: None).tokenizer


def _megazoo_to_hf(args: argparse.Namespace) -> int:
    check_out_dir(args.out)
    from megazoo.models.hf.convert_lora import export_lora, lora_checkpoint

    if args.merge_lora or args.peft_adapter:  # a LoRA run's checkpoint: models/hf/convert_lora.py
        if args.merge_lora and args.peft_adapter:
            raise ValueError("give --merge-lora (a merged HF model) or --peft-adapter (the adapter alone), not both")
        tokenizer = export_tokenizer(args.checkpoint, args.tokenizer) if args.merge_lora else None
        with staged_out_dir(args.out) as staging:
            cfg, what = export_lora(args.checkpoint, staging, merge=args.merge_lora, base=args.lora_base,
                                    tokenizer=tokenizer)
        print(f"converted megazoo LoRA checkpoint {args.checkpoint} ({cfg.name}) to {what} {args.out}")
        return 0
    if lora_checkpoint(args.checkpoint)[1] is not None:
        raise ValueError(f"checkpoint {args.checkpoint} is a LoRA run's (it holds only the adapters): pass "
                         "--merge-lora (merged HF model) or --peft-adapter (PEFT adapter folder)")
    tokenizer = export_tokenizer(args.checkpoint, args.tokenizer)  # bad --tokenizer: refused before the read
    slices = _verify_data(args)
    cfg = load_consolidated_config(args.checkpoint)
    if cfg.positions == "learned":  # the GPT-2 block
        from megazoo.models.hf.gpt2 import export_hf_dir
        family = "GPT-2"
    elif cfg.n_experts or cfg.qk_norm:  # Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3
        from megazoo.models.hf.moe_families import export_hf_dir, hf_family
        family = hf_family(cfg)
    else:
        from megazoo.models.hf.llama import export_hf_dir, hf_family
        family = hf_family(cfg)  # refuses a config no HF family computes, before the read
    cfg, full_state = load_consolidated(args.checkpoint)
    try:
        with staged_out_dir(args.out) as staging:
            export_hf_dir(full_state, cfg, staging, tokenizer=tokenizer)
            if args.verify:  # the directory as transformers loads it, against the checkpoint's weights
                _verified(cfg, full_state, staging, slices)
    except ConversionRefused as refused:
        print(f"megazoo: convert megazoo-to-hf: {refused}", file=sys.stderr)
        return 1
    what = "with its tokenizer" if tokenizer is not None else "without a tokenizer (none recorded or given)"
    print(f"converted megazoo checkpoint {args.checkpoint} ({cfg.name}) to HF {family} directory {args.out}, {what}")
    return 0


VERIFY_HELP = ("after converting, run a fixed sample through megazoo and through transformers (fp64) and compare "
               "logits and loss, and score a WikiText and a LAMBADA slice both ways (when the data is found); exit 1 "
               "and write nothing beyond the tolerance (models/hf/convert_verify.py, convert_slices.py)")


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    parser.add_argument("--verify-data", default=None, metavar="DIR", help="data folder for --verify's slices "
                        "(wikitext103/, lambada/, gpt2_bpe/); default: $MEGAZOO_DATA_DIR, else the cache")
    parser.add_argument("--verify-tokens", type=int, default=1024, metavar="N",
                        help="WikiText tokens --verify scores (default 1024)")
    parser.add_argument("--verify-lambada", type=int, default=20, metavar="N",
                        help="LAMBADA passages --verify scores (default 20)")


def _run(func):
    """Wrap a command so bad input ends with one clear line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (FileNotFoundError, ValueError, ConnectionError) as error:  # CheckpointError is a ValueError
            print(f"megazoo: error: {error}", file=sys.stderr)
            return 2

    return run


def register(subparsers) -> argparse.ArgumentParser:
    """Add `convert` (with `hf-to-megazoo` and `megazoo-to-hf`) to the `megazoo` command's subparsers."""
    convert = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face (GPT-2, Llama, Qwen2, "
                                    "Mistral) and megazoo")
    sub = convert.add_subparsers(dest="direction", required=True)
    to_mz = sub.add_parser("hf-to-megazoo", help="HF GPT-2 / Llama / Qwen2 / Mistral directory -> consolidated "
                           "megazoo checkpoint")
    to_mz.add_argument("hf_dir", help="HF directory (config.json + model.safetensors, its index, or pytorch_model.bin)")
    to_mz.add_argument("--out", required=True, help="new (or empty) output directory, written in full or not at all")
    _verify_arguments(to_mz)
    to_mz.set_defaults(func=_run(_hf_to_megazoo))
    to_hf = sub.add_parser("megazoo-to-hf", help="megazoo checkpoint (any layout) -> HF directory (GPT-2, or the "
                           "Llama / Qwen2 / Mistral family its config computes) + tokenizer")
    to_hf.add_argument("checkpoint", help="megazoo checkpoint: a step_N directory or a checkpoints folder (its latest good one)")
    to_hf.add_argument("--out", required=True, help="new (or empty) output directory, written in full or not at all")
    to_hf.add_argument("--tokenizer", default=None, metavar="TOK",
                       help="tokenizer to write beside the weights (a GPT-2 BPE directory, a tokenizer .json, a "
                            "sentencepiece .model or hf:NAME); default: the one the checkpoint records; none: "
                            "no tokenizer. Its end-of-text id becomes the model's bos / eos / pad id")
    _verify_arguments(to_hf)
    to_hf.add_argument("--merge-lora", action="store_true", help="a LoRA run's checkpoint: fold the adapters into "
                       "the base weights (W += alpha/r B A) and write a plain HF model")
    to_hf.add_argument("--peft-adapter", action="store_true", help="a LoRA run's checkpoint: write the adapter "
                       "alone in PEFT's format (adapter_config.json + adapter_model.safetensors)")
    to_hf.add_argument("--lora-base", default=None, metavar="CKPT", help="the LoRA base checkpoint (default: the "
                       "checkpoint.load its recipe recorded)")
    to_hf.set_defaults(func=_run(_megazoo_to_hf))
    return convert
