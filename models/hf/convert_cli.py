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
import dataclasses
import os
import shutil
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from megazoo.models.config import ModelConfig
from megazoo.data.fileio import check_out_dir, ensure_empty_out_dir, staged_out_dir  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # torch and the checkpoint modules load when a conversion runs, not for `megazoo convert --help`
    import torch


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


def _hf_to_megazoo(args: argparse.Namespace) -> int:
    from megazoo.models.hf.converter import check_hf_names, megazoo_tensors
    from megazoo.models.hf.families import read_hf_config
    from megazoo.models.hf.safetensors_files import HFWeights
    from megazoo.parallel.checkpoint.consolidate import CheckpointReader, write_streamed_checkpoint

    check_out_dir(args.out, args.overwrite)  # checked before the (slow) read
    slices = _verify_data(args)
    family, cfg, _ = read_hf_config(args.hf_dir)  # a model_type no family converts: refused here
    weights = HFWeights(args.hf_dir)  # headers only: a missing shard or an index naming a missing file is refused
    check_hf_names(weights, family, cfg)  # missing / extra tensors, shapes, dtypes: refused before anything is written
    tokenizer = _hf_tokenizer_files(args.hf_dir) if family.name != "GPT-2" else []
    largest = max(weights.nbytes(n) for n in weights.names())  # a rank file holds at most this much
    try:
        with staged_out_dir(args.out, args.overwrite) as staging:
            record = None
            if tokenizer:  # the checkpoint keeps its own copy; the record names where it will be after the rename
                from megazoo.data.tokenizers.loading import load_hf_tokenizer
                from megazoo.data.tokenizers.store import tokenizer_record

                (staging / HF_TOKENIZER_DIR).mkdir()
                for file in tokenizer:
                    shutil.copyfile(file, staging / HF_TOKENIZER_DIR / file.name)
                record = tokenizer_record(load_hf_tokenizer(str(staging / HF_TOKENIZER_DIR)))
                record["source"] = str(Path(args.out).resolve() / HF_TOKENIZER_DIR)
            write_streamed_checkpoint(megazoo_tensors(weights, family, cfg), dataclasses.asdict(cfg), staging,
                                      tokenizer=record, file_bytes=largest)
            if args.verify:  # the checkpoint as written, read back tensor by tensor, against the HF source
                reader = CheckpointReader(staging)
                _verified(cfg, _lazy(reader), args.hf_dir, slices)
    except ConversionRefused as refused:
        print(f"megazoo: convert hf-to-megazoo: {refused}", file=sys.stderr)
        return 1
    what = "with its tokenizer" if tokenizer else "without a tokenizer (none in the HF directory)"
    print(f"converted HF {family.exports(cfg)} {args.hf_dir} ({cfg.num_parameters():,} parameters, "
          f"{'/'.join(sorted(weights.dtypes()))}) to megazoo checkpoint {args.out}, {what}")
    return 0


def _lazy(reader, dtype=None):
    """The checkpoint's full state as a mapping read tensor by tensor (convert_verify builds its model from it)."""
    from megazoo.models.hf.converter import LazyState

    return LazyState(reader.read, reader.names(), dtype)


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
    check_out_dir(args.out, args.overwrite)
    from megazoo.models.hf.convert_lora import export_lora, lora_checkpoint
    from megazoo.models.hf.converter import parse_dtype
    from megazoo.models.hf.safetensors_files import parse_size, storable

    dtype, max_shard = parse_dtype(args.dtype), parse_size(args.max_shard_size)  # bad values: refused first
    if args.merge_lora or args.peft_adapter:  # a LoRA run's checkpoint: models/hf/convert_lora.py
        if args.merge_lora and args.peft_adapter:
            raise ValueError("give --merge-lora (a merged HF model) or --peft-adapter (the adapter alone), not both")
        tokenizer = export_tokenizer(args.checkpoint, args.tokenizer) if args.merge_lora else None
        slices = _verify_data(args) if args.merge_lora else None
        try:
            with staged_out_dir(args.out, args.overwrite) as staging:
                cfg, what, merged = export_lora(args.checkpoint, staging, merge=args.merge_lora, base=args.lora_base,
                                                tokenizer=tokenizer, dtype=dtype, max_shard_bytes=max_shard)
                if args.verify and merged is not None:  # the merged folder against the merged weights, streamed
                    _verified(cfg, merged[0], staging, slices)
        except ConversionRefused as refused:
            print(f"megazoo: convert megazoo-to-hf: {refused}", file=sys.stderr)
            return 1
        print(f"converted megazoo LoRA checkpoint {args.checkpoint} ({cfg.name}) to {what} {args.out}")
        return 0
    if lora_checkpoint(args.checkpoint)[1] is not None:
        raise ValueError(f"checkpoint {args.checkpoint} is a LoRA run's (it holds only the adapters): pass "
                         "--merge-lora (merged HF model) or --peft-adapter (PEFT adapter folder)")
    tokenizer = export_tokenizer(args.checkpoint, args.tokenizer)  # bad --tokenizer: refused before the read
    slices = _verify_data(args)
    from megazoo.models.hf.convert_lora import chat_export
    from megazoo.models.hf.converter import write_hf_folder
    from megazoo.models.hf.families import family_of_config
    from megazoo.parallel.checkpoint.consolidate import CheckpointReader

    reader = CheckpointReader(args.checkpoint)  # every file's sha256 checked; no tensor read yet
    cfg = _model_config(reader.common)
    family = family_of_config(cfg)  # refuses a config no HF family computes, before the read
    dtype = storable(dtype or reader.param_dtype(), "the checkpoint's parameter dtype (--dtype auto)")
    try:
        with staged_out_dir(args.out, args.overwrite) as staging:
            files = write_hf_folder(staging, family, cfg, reader.read, dtype, tokenizer=tokenizer,
                                    max_shard_bytes=max_shard)
            chat_export(staging, reader.common, tokenizer)
            if args.verify:  # the directory as transformers loads it, against the checkpoint's weights in `dtype`
                _verified(cfg, _lazy(reader, dtype), staging, slices)
    except ConversionRefused as refused:
        print(f"megazoo: convert megazoo-to-hf: {refused}", file=sys.stderr)
        return 1
    what = "with its tokenizer" if tokenizer is not None else "without a tokenizer (none recorded or given)"
    if cfg.mtp_depth and not family.mtp:  # models/hf/family.py: exported_config
        print(f"the {cfg.mtp_depth} multi-token prediction module(s) are left out: HF {family.exports(cfg)} has no "
              "place for them (the exported model's logits are the main model's, as with them)")
    print(f"converted megazoo checkpoint {args.checkpoint} ({cfg.name}) to HF {family.exports(cfg)} directory "
          f"{args.out} ({len(files)} safetensors file(s), {str(dtype).removeprefix('torch.')}), {what}")
    return 0


def export_run(checkpoint: str | Path, out: str | Path, *, lora: bool) -> None:
    """`checkpoint.export_hf`: a finished run's last checkpoint as an HF folder, as `megazoo convert megazoo-to-hf
    --verify` writes it (a LoRA run's merged); a failure raises CheckpointError naming the command to retry."""
    from megazoo.parallel.checkpoint.io import CheckpointError

    args = argparse.Namespace(checkpoint=str(checkpoint), out=str(out), dtype="auto", max_shard_size="5GB",
                              merge_lora=lora, peft_adapter=False, overwrite=False, lora_base=None, tokenizer=None,
                              verify=True, verify_data=None, verify_tokens=1024, verify_lambada=20)
    if _run(_megazoo_to_hf)(args) != 0:
        raise CheckpointError(f"checkpoint.export_hf = {out}: the HF export of {checkpoint} failed (above); the "
                              f"checkpoint is intact: megazoo convert megazoo-to-hf {checkpoint} --out {out} "
                              f"--verify{' --merge-lora' if lora else ''}")


VERIFY_HELP = ("after converting, run a fixed sample through megazoo and through transformers (fp64) and compare "
               "logits and loss, and score a WikiText and a LAMBADA slice both ways (when the data is found); exit 1 "
               "and write nothing beyond the tolerance (models/hf/convert_verify.py, convert_slices.py)")


def out_arguments(parser: argparse.ArgumentParser) -> None:
    """--out and --overwrite, the same for every direction."""
    parser.add_argument("--out", required=True, help="new (or empty) output directory, written in full or not at all "
                        "(into a temporary folder beside it, renamed at the end)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out, only once "
                        "the new one is complete (default: refuse it)")


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
    out_arguments(to_mz)
    _verify_arguments(to_mz)
    to_mz.set_defaults(func=_run(_hf_to_megazoo))
    to_hf = sub.add_parser("megazoo-to-hf", help="megazoo checkpoint (any layout) -> HF directory (GPT-2, or the "
                           "Llama / Qwen2 / Mistral family its config computes) + tokenizer")
    to_hf.add_argument("checkpoint", help="megazoo checkpoint: a step_N directory or a checkpoints folder (its latest good one)")
    out_arguments(to_hf)
    to_hf.add_argument("--tokenizer", default=None, metavar="TOK",
                       help="tokenizer to write beside the weights (a GPT-2 BPE directory, a tokenizer .json, a "
                            "sentencepiece .model or hf:NAME); default: the one the checkpoint records; none: "
                            "no tokenizer. Its end-of-text id becomes the model's bos / eos / pad id")
    _verify_arguments(to_hf)
    to_hf.add_argument("--dtype", default="auto", metavar="DTYPE", help="dtype of the written weights: auto (the "
                       "checkpoint's parameter dtype: bf16 stays bf16), fp32, bf16 or fp16")
    to_hf.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors file "
                       "(transformers' convention: 5GB default, or MB, GiB, bytes); more files get an index")
    to_hf.add_argument("--merge-lora", action="store_true", help="a LoRA run's checkpoint: fold the adapters into "
                       "the base weights (W += alpha/r B A) and write a plain HF model")
    to_hf.add_argument("--peft-adapter", action="store_true", help="a LoRA run's checkpoint: write the adapter "
                       "alone in PEFT's format (adapter_config.json + adapter_model.safetensors)")
    to_hf.add_argument("--lora-base", default=None, metavar="CKPT", help="the LoRA base checkpoint (default: the "
                       "checkpoint.load its recipe recorded)")
    to_hf.set_defaults(func=_run(_megazoo_to_hf))
    from megazoo.models.hf.convert_dcp import register_dcp

    register_dcp(sub, _run, out_arguments)
    return convert
