"""What a published report states for the layout a shipped recipe reproduces, printed beside `megazoo plan
--recipe`'s own numbers (`reported_lines`), so that a reader sees which figures are the report's and which are the
planner's, and where the two differ.

Only figures the reports state are given (a memory per GPU is stated by neither: the planner's stands alone).
Sources: [DeepSeek-V3] DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437, sec. 3.1-3.2 (2,048
H800s, 8 per node; pp 16, ep 64 over 8 nodes, ZeRO-1 dp, no tp), sec. 4.2 (14.8T tokens, batch to 15,360 x 4K),
table 1 (2.664M H800 GPU hours of pre-training, 2.788M in all), and the HF release's README_WEIGHTS.md (685B =
671B main model + 14B multi-token prediction module, which counts the module's own copies of the embedding and
the output head); [Kimi K2] Kimi Team 2025, arXiv:2507.20534,
sec. 2.4.2-2.4.3 (pp 16 with virtual stages, ep 16, ZeRO-1 on multiples of 32 nodes of 8 H800s; 15.5T tokens,
67M tokens a batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Reported:
    source: str
    gpus: int
    gpu: str
    pp: int
    ep: int
    tp: int
    zero: int
    total_params: float
    active_params: float
    tokens: float
    batch_tokens: float
    gpu_hours: float  # pre-training's (0: not stated)
    peak_flops: float  # the GPU's dense bf16 peak, for the report's implied utilisation
    notes: tuple[str, ...]
    mtp_params: float = 0.0  # the multi-token prediction modules' (0: none stated), apart from total_params


REPORTED = {
    "deepseek-v3": Reported(
        "DeepSeek-V3 Technical Report (arXiv:2412.19437)", 2048, "H800", 16, 64, 1, 1, 671e9, 37e9, 14.8e12,
        15360 * 4096, 2.664e6, 989e12,
        ("2.788M H800 GPU hours in all: 2.664M pre-training + 119K context extension + 5K post-training (table 1)",
         "the report trains with DualPipe, FP8 mixed precision and recomputes only RMSNorm and the MLA "
         "up-projections; this recipe: 1F1B, bf16, full activation checkpointing",
         "the report ramps the batch from 3,072 to 15,360 sequences over 469B tokens; this recipe runs 15,360 "
         "from step 0",
         "the report limits each token to 4 nodes; this recipe's group-limited routing (4 of 8 groups) stands in"),
        14e9),
    "kimi-k2": Reported(
        "Kimi K2 report (arXiv:2507.20534)", 256, "H800", 16, 16, 1, 1, 1.04e12, 32.6e9, 15.5e12, 67e6, 0.0,
        989e12,
        ("the report's layout runs on any multiple of 32 nodes (256 GPUs here); it fits H800s by recomputation, "
         "FP8 activation storage and CPU offload, none of which megazoo does: this recipe targets H200-141GB",
         "the report trains with MuonClip and interleaved virtual stages; this recipe: AdamW, 1F1B")),
}


def _num(x: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if abs(x) >= size:
            return f"{x / size:.4g}{unit}"
    return f"{x:,.0f}"


def reported_lines(recipe: str | Path, resolved, cfg, peak_flops: float | None = None) -> list[str]:
    """The report's figures beside the recipe's, one line each ([] for a recipe no report is listed for).
    `resolved`: the recipe as planning resolves it (recipes/resolve.py); `peak_flops`: the planned GPU's."""
    from megazoo.models.flops import model_flops_per_token

    rep = REPORTED.get(Path(str(recipe)).name.removesuffix(".toml"))
    if rep is None:
        return []
    par, train = resolved.recipe.parallel, resolved.recipe.train
    world = par.dp * par.tp * par.pp * par.cp
    tokens = train.steps * resolved.global_batch * train.seq_len
    per_token = model_flops_per_token(cfg, train.seq_len)
    # multi-token prediction apart: the report's 671B / 37B are the main model's (the FLOPs count both)
    main = cfg.replace(mtp_depth=0)
    mtp = cfg.num_parameters() - main.num_parameters()
    params = "parameters (total / active)", f"{_num(rep.total_params)} / {_num(rep.active_params)}", \
        f"{_num(cfg.num_parameters())} / {_num(cfg.num_active_parameters())}"
    if rep.mtp_params or mtp:
        params = ("parameters (main + MTP / active)", f"{_num(rep.total_params)} + {_num(rep.mtp_params)} MTP / {_num(rep.active_params)}",
                  f"{_num(main.num_parameters())} + {_num(mtp)} MTP / {_num(main.num_active_parameters())}")
    rows = [("GPUs", f"{rep.gpus:,} {rep.gpu}", f"{world:,}"),
            ("pp x ep x tp, ZeRO", f"{rep.pp} x {rep.ep} x {rep.tp}, ZeRO-{rep.zero}",
             f"{par.pp} x {par.ep} x {par.tp}, ZeRO-{resolved.recipe.zero.stage}"),
            params,
            ("tokens per batch", _num(rep.batch_tokens), _num(resolved.global_batch * train.seq_len)),
            ("training tokens", _num(rep.tokens), _num(tokens))]
    if rep.gpu_hours:
        implied = per_token * rep.tokens / (rep.gpu_hours * 3600 * rep.peak_flops)
        rows.append(("pre-training GPU hours", f"{rep.gpu_hours / 1e6:.3f}M",
                     f"{per_token * tokens / (implied * (peak_flops or rep.peak_flops) * 3600) / 1e6:.3f}M at the "
                     f"report's implied {100 * implied:.1f}% of the dense bf16 peak"))
    width = max(len(r[0]) for r in rows)
    out = [f"  beside the {rep.source}'s own figures (report | this plan):"]
    out += [f"    {name:<{width}}  {theirs} | {ours}" for name, theirs, ours in rows]
    out += [f"    differs: {note}" for note in rep.notes]
    if rep.mtp_params and mtp:  # the HF release's MTP figure holds the module's embedding and head copies
        copies = 2 * cfg.mtp_depth * cfg.vocab_size * cfg.d_model
        out.append(f"    differs: the {_num(rep.mtp_params)} MTP figure is the HF release's, with the module's copies "
                   f"of the embedding and the output head (2 x {_num(copies / 2 / cfg.mtp_depth)}): {_num(mtp)} + "
                   f"{_num(copies)} = {_num(mtp + copies)} here, which the recipe's export writes too")
    mtp_flops = (f" ({per_token - model_flops_per_token(main, train.seq_len):.3e} of them in multi-token "
                 f"prediction, depth {cfg.mtp_depth})") if cfg.mtp_depth else ""
    out.append(f"    the report states no memory per GPU; FLOPs per token (models/flops.py): {per_token:.3e}{mtp_flops}")
    return out
