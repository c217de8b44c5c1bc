"""The README (the user guide of the `megazoo` command and its recipes), read as a new user reads it, stays in step
with the code: "Set-up: two commands" is followed by two, the recipe-keys table names every section and key
`recipes/config.py` accepts, the models tables every preset, and `megazoo data fetch`'s offline answers are there."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megazoo.models.presets import presets
from megazoo.recipes.config import Recipe

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def test_set_up_says_two_commands_and_gives_two_then_how_to_activate():
    setup = _section("Set-up: two commands")
    blocks = re.findall(r"```bash\n(.*?)```", setup, re.S)
    commands = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert [line.split("#")[0].strip() for line in commands] == ["make demo", "make test"]
    assert ". .venv/bin/activate" in setup and "3.0 GB `.venv`" in setup


def test_the_recipe_keys_table_names_every_section_and_key():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `\[(\w+)\]` \| (.*) \|$", _section("Recipes"), re.M)}
    missing = []
    for section in dataclasses.fields(Recipe):
        row = rows.get(section.name)
        if row is None:
            missing.append(f"[{section.name}]")
            continue
        missing += [f"{section.name}.{key.name}" for key in dataclasses.fields(section.default_factory())
                    if f"`{key.name}`" not in row]
    assert missing == []  # e.g. [lora], run.existing and train.compile were absent


def test_the_models_tables_list_every_preset():
    rows = set(re.findall(r"^\| ([\w.\-]+) \|", _section("Models"), re.M))
    assert [name for name in presets() if name not in rows] == []  # gpt-1t was absent


def test_the_offline_answers_and_the_exports_are_documented():
    data = _section("Data: `megazoo data fetch`")
    for needle in ("--mirror URL", "file:///PATH", "MEGAZOO_DATA_DIR=PATH", "--dir PATH"):
        assert needle in data, needle
    for needle in ("--merge-lora", "--peft-adapter", "--lora-base CKPT", "megazoo convert hf-to-megazoo HF_LLAMA",
                   "a whole file is one document", "with the evaluation\ndata present"):
        assert needle in README, needle
