"""`megazoo convert hf-to-megazoo HF_DIR --out DIR` and `megazoo convert megazoo-to-hf CKPT --out DIR`.

Also the consolidated megazoo checkpoint these commands read and write (a simple interim format, until the
checkpoint work brings sharded checkpoints):

    DIR/model.pt      torch.save of the full state dict {our parameter name: full tensor}, embedding at the
                      true vocabulary size (the format of models.weights.full_state_dict)
    DIR/config.json   {"format": "megazoo-consolidated", "version": 1, "model": {ModelConfig fields},
                       "weights": {"file": "model.pt", "bytes": N, "sha256": "..."}}

The size and sha256 detect a truncated or corrupt model.pt before it is unpickled.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import torch

from models.config import ModelConfig

FORMAT, VERSION = "megazoo-consolidated", 1
WEIGHTS_FILE, CONFIG_FILE = "model.pt", "config.json"


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or corrupt; the message names the path."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_empty_out_dir(out_dir: str | Path) -> Path:
    """`out_dir`, created if needed; refuses a non-empty one so no earlier result is ever overwritten."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"output directory {out_dir} exists and is not empty: choose a new --out "
                              "(nothing is overwritten)")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def save_consolidated(full_state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write a consolidated checkpoint into `out_dir` (which must be empty or absent)."""
    out_dir = ensure_empty_out_dir(out_dir)
    weights = out_dir / WEIGHTS_FILE
    torch.save({name: t.detach().cpu().contiguous() for name, t in full_state.items()}, weights)
    meta = {"format": FORMAT, "version": VERSION, "model": dataclasses.asdict(cfg),
            "weights": {"file": WEIGHTS_FILE, "bytes": weights.stat().st_size, "sha256": _sha256(weights)}}
    # config.json last: a directory without it is an interrupted write, never mistaken for a checkpoint.
    (out_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out_dir


def load_consolidated_config(ckpt_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a consolidated checkpoint (cheap: the weights are not read)."""
    return _read_meta(Path(ckpt_dir))[0]


def load_consolidated(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full state) of a consolidated checkpoint, after checking the weights' size and sha256."""
    ckpt_dir = Path(ckpt_dir)
    cfg, meta = _read_meta(ckpt_dir)
    weights = ckpt_dir / meta["weights"]["file"]
    if not weights.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no weights file {weights.name}")
    if weights.stat().st_size != meta["weights"]["bytes"] or _sha256(weights) != meta["weights"]["sha256"]:
        raise CheckpointError(f"checkpoint weights {weights} are corrupt or truncated: size/sha256 differ from "
                              f"{ckpt_dir / CONFIG_FILE}")
    return cfg, torch.load(weights, map_location="cpu", weights_only=True)


def _read_meta(ckpt_dir: Path) -> tuple[ModelConfig, dict]:
    config = ckpt_dir / CONFIG_FILE
    if not config.is_file():
        raise CheckpointError(f"{ckpt_dir} is not a megazoo checkpoint: {config} not found")
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{config} is not a {FORMAT} config (format = {meta.get('format')!r}); "
                                  "for a Hugging Face directory use hf-to-megazoo or --hf")
        return ModelConfig(**meta["model"]), meta
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint config {config} is corrupt: {error!r}") from error


def _hf_to_megazoo(args: argparse.Namespace) -> int:
    from models.gpt2.hf import read_hf_dir

    out = ensure_empty_out_dir(args.out)  # checked before the (slow) read
    cfg, full_state = read_hf_dir(args.hf_dir)
    save_consolidated(full_state, cfg, out)
    print(f"converted HF GPT-2 {args.hf_dir} ({cfg.num_parameters():,} parameters) to megazoo checkpoint {out}")
    return 0


def _megazoo_to_hf(args: argparse.Namespace) -> int:
    from models.gpt2.hf import export_hf_dir

    out = ensure_empty_out_dir(args.out)
    cfg, full_state = load_consolidated(args.checkpoint)
    export_hf_dir(full_state, cfg, out, tokenizer_dir=args.tokenizer)
    print(f"converted megazoo checkpoint {args.checkpoint} ({cfg.name}) to HF GPT-2 directory {out}")
    return 0


def _run(func):
    """Wrap a command so bad input ends with one clear line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (FileNotFoundError, ValueError) as error:  # CheckpointError is a ValueError
            print(f"megazoo: error: {error}", file=sys.stderr)
            return 2

    return run


def register(subparsers) -> argparse.ArgumentParser:
    """Add `convert` (with `hf-to-megazoo` and `megazoo-to-hf`) to the `megazoo` command's subparsers."""
    convert = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face GPT-2 and megazoo")
    sub = convert.add_subparsers(dest="direction", required=True)
    to_mz = sub.add_parser("hf-to-megazoo", help="HF GPT-2 directory -> consolidated megazoo checkpoint")
    to_mz.add_argument("hf_dir", help="HF GPT-2 directory (config.json + model.safetensors or pytorch_model.bin)")
    to_mz.add_argument("--out", required=True, help="new (empty) output directory")
    to_mz.set_defaults(func=_run(_hf_to_megazoo))
    to_hf = sub.add_parser("megazoo-to-hf", help="consolidated megazoo checkpoint -> HF GPT-2 directory")
    to_hf.add_argument("checkpoint", help="megazoo checkpoint directory (config.json + model.pt)")
    to_hf.add_argument("--out", required=True, help="new (empty) output directory")
    to_hf.add_argument("--tokenizer", default=None,
                       help="GPT-2 BPE directory to copy in as vocab.json + merges.txt (optional)")
    to_hf.set_defaults(func=_run(_megazoo_to_hf))
    return convert
