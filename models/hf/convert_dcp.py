"""`megazoo convert megazoo-to-dcp CKPT --out DIR` and `megazoo convert dcp-to-megazoo DIR --out CKPT`: megazoo
checkpoints as torch.distributed.checkpoint (DCP) folders and back, through torch's own DCP
(parallel/checkpoint/dcp.py), so a torchtitan Llama 3 checkpoint loads into megazoo (then into any layout) and a
megazoo run goes to torchtitan's layout: its names and its q / k row order come from the family's `torchtitan`
key map (models/hf/llama.py: torchtitan_entries). DCP keeps no model config, so the HF config.json of the
architecture is written beside the DCP files and read back (or given with --config). Both directions stream: one
tensor held at a time (parallel/checkpoint/dcp.py: save_dcp_streamed resolves each tensor as DCP's writer reaches it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from megazoo.data.fileio import check_out_dir, staged_out_dir
from megazoo.models.config import ModelConfig


def _dcp_view(family, cfg, names: str):
    """The family read / written under DCP names: torchtitan's key map, or megazoo's own names one to one."""
    from megazoo.models.hf.family import Entry
    from megazoo.models.layout import parameter_layout

    if names == "torchtitan":
        if family.torchtitan is None:
            raise ValueError(f"model {cfg.name}: the {family.name} family has no torchtitan key map")
        return dataclasses.replace(family, entries=family.torchtitan, tied_head=lambda cfg: None, ignored=(),
                                   written=None)
    def own(cfg):
        return [Entry(p.name, (p.name,), (p.shape,)) for p in parameter_layout(cfg, vocab=cfg.vocab_size)]
    return dataclasses.replace(family, entries=own, tied_head=lambda cfg: None, ignored=(), written=None)


def dcp_family(reader, family, cfg) -> tuple[str, object]:
    """(which names, the key map) of a DCP folder's model keys: torchtitan's when it holds tok_embeddings.weight,
    else megazoo's own (`megazoo-to-dcp --names megazoo`). Used by dcp-to-megazoo and by a run whose
    checkpoint.load is such a folder (recipes/training/checkpointing.py: load_dcp_weights)."""
    names = "torchtitan" if "tok_embeddings.weight" in reader.names() else "megazoo"
    return names, _dcp_view(family, cfg, names)


def _megazoo_to_dcp(args: argparse.Namespace) -> int:
    """A megazoo checkpoint (any layout) as a torch.distributed.checkpoint folder, with the HF config.json of its
    architecture beside (DCP keeps no model config); torchtitan's names (--names torchtitan) or megazoo's."""
    from megazoo.models.hf.families import family_of_config
    from megazoo.parallel.checkpoint.consolidate import CheckpointReader
    from megazoo.parallel.checkpoint.dcp import save_dcp_streamed

    check_out_dir(args.out, args.overwrite)
    reader = CheckpointReader(args.checkpoint)
    cfg = ModelConfig(**reader.common["model"])
    family = family_of_config(cfg)
    view = _dcp_view(family, cfg, args.names)
    entries = view.entries(cfg)
    plan = [(n, tuple(shape), reader.dtype(e.ours)) for e in entries for n, shape in zip(e.hf, e.hf_shapes)]
    owner = {n: e for e in entries for n in e.hf}
    pending: dict = {}

    def get(name: str):  # one megazoo tensor read, split by the key map, its pieces handed out as DCP asks
        if name not in pending:
            pending.update(zip(owner[name].hf, owner[name].split(reader.read(owner[name].ours))))
        return pending.pop(name)

    with staged_out_dir(args.out, args.overwrite) as staging:
        save_dcp_streamed(plan, get, staging)
        family.config_to_hf(cfg).save_pretrained(str(staging))
    print(f"converted megazoo checkpoint {args.checkpoint} ({cfg.name}) to a DCP folder {args.out} "
          f"({args.names} names)")
    return 0


def _dcp_to_megazoo(args: argparse.Namespace) -> int:
    """A DCP folder (torchtitan's or megazoo's names, found from its keys) -> a megazoo checkpoint, tensor by tensor;
    the architecture from --config (an HF folder or config.json), else the config.json beside the DCP files."""
    from megazoo.models.hf.converter import check_hf_names, megazoo_tensors
    from megazoo.models.hf.families import read_hf_config
    from megazoo.parallel.checkpoint.consolidate import write_streamed_checkpoint
    from megazoo.parallel.checkpoint.dcp import DCPReader

    check_out_dir(args.out, args.overwrite)
    reader = DCPReader(args.dcp_dir)
    config = Path(args.config or args.dcp_dir)
    family, cfg, _ = read_hf_config(config.parent if config.name == "config.json" else config)
    names, view = dcp_family(reader, family, cfg)
    check_hf_names(reader, view, cfg)  # missing / extra keys, shapes, dtypes: refused before anything is written
    import torch

    largest = max(math.prod(reader.shape(n)) * getattr(torch, reader.dtype(n).removeprefix("torch.")).itemsize
                  for n in reader.names())  # a rank file holds at most this much: one tensor at a time
    with staged_out_dir(args.out, args.overwrite) as staging:
        write_streamed_checkpoint(megazoo_tensors(reader, view, cfg), dataclasses.asdict(cfg), staging,
                                  file_bytes=largest)
    print(f"converted DCP folder {args.dcp_dir} ({names} names) to megazoo checkpoint {args.out}")
    return 0


def register_dcp(sub, run, out_arguments) -> None:
    """Add the two DCP directions to `megazoo convert`'s subparsers (`run` wraps a handler's bad input)."""
    to_dcp = sub.add_parser("megazoo-to-dcp", help="megazoo checkpoint -> torch.distributed.checkpoint folder")
    to_dcp.add_argument("checkpoint")
    out_arguments(to_dcp)
    to_dcp.add_argument("--names", choices=("torchtitan", "megazoo"), default="torchtitan",
                        help="torchtitan's Llama 3 keys (default) or megazoo's own")
    to_dcp.set_defaults(func=run(_megazoo_to_dcp))
    from_dcp = sub.add_parser("dcp-to-megazoo", help="torch.distributed.checkpoint folder (torchtitan's or "
                              "megazoo's names) -> megazoo checkpoint")
    from_dcp.add_argument("dcp_dir")
    out_arguments(from_dcp)
    from_dcp.add_argument("--config", default=None, help="HF folder or config.json giving the architecture "
                          "(default: the config.json in DCP_DIR)")
    from_dcp.set_defaults(func=run(_dcp_to_megazoo))
