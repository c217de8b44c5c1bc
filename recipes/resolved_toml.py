"""The resolved recipe as TOML: every field after `--set` overrides, data paths found and derived values filled
in, written to run.dir/recipe.resolved.toml by the training run (recipes/train.py, rank 0).

It is a recipe itself: `megazoo train run.dir/recipe.resolved.toml` trains the same model on the same data from
any directory (data paths are absolute once resolved). [model] lists every ModelConfig field, resolved (the
preset after overrides, the vocabulary taken from the tokenizer, or the checkpoint's architecture); [train]
states global_batch and lr_decay_steps. Values that are not recipe keys (padded vocabulary, world size, tokens
per step, pipeline blocks) are in the header comment. A key whose value is unset (None) is written as a
comment, since TOML has no null.
"""

from __future__ import annotations

import dataclasses
import json
import math

from megazoo.recipes.resolve import Resolved


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def resolved_table(res: Resolved) -> dict[str, dict]:
    """The recipe as {section: {key: value}}, with the resolved model and the derived train keys."""
    table = res.recipe.to_dict()
    model = dataclasses.asdict(res.model)
    model.pop("name")
    table["model"] = {"preset": res.recipe.model.preset, "from_checkpoint": res.recipe.model.from_checkpoint,
                      **({"from_hf": res.recipe.model.from_hf} if res.recipe.model.from_hf else {}), **model}
    table["train"].update(global_batch=res.global_batch, lr_decay_steps=res.lr_decay_steps)
    return table


def resolved_toml(res: Resolved) -> str:
    lines = [f"# megazoo resolved recipe: {res.model.name}, {res.model.num_parameters():,} parameters "
             f"(padded vocabulary {res.padded_vocab:,}); {res.world_size} process(es); global batch "
             f"{res.global_batch} x {res.recipe.train.seq_len} = {res.tokens_per_step:,} tokens per step;",
             f"# pipeline blocks per (virtual) stage: {res.stage_layers}. Train it again with "
             "`megazoo train THIS_FILE`.", ""]
    for section, values in resolved_table(res).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"# {key} is unset" if value is None else f"{key} = {_value(value)}")
        lines.append("")
    return "\n".join(lines)
