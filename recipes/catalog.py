"""The recipes shipped with megazoo, reachable by name from any install: `megazoo train demo`, `megazoo recipes`.

The TOML files in recipes/ install as package data of `megazoo.recipes` (pyproject.toml's package-data), so a
wheel carries them. `find_recipe(arg)` turns what the user typed into a file: an existing path wins (a user's
own `demo.toml` in the current directory is theirs, not ours); otherwise a shipped name, with or without
".toml". The first sentence of each recipe's opening comment is its one-line description.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from megazoo.recipes.config import RecipeError


def shipped_recipes() -> dict[str, Path]:
    """{name: file} of every recipe shipped in the megazoo.recipes package, sorted by name."""
    folder = resources.files("megazoo.recipes")
    return {Path(entry.name).stem: Path(str(entry))
            for entry in sorted(folder.iterdir(), key=lambda e: e.name) if entry.name.endswith(".toml")}


def find_recipe(arg: str) -> Path:
    """The recipe file `arg` names: an existing file, or a shipped recipe's name (`demo`, `demo.toml`)."""
    path = Path(arg)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    name = path.name[:-len(".toml")] if path.name.endswith(".toml") else path.name
    if name in shipped and (len(path.parts) == 1 or path.parent.name == "recipes"):
        return shipped[name]
    raise RecipeError(f"recipe {arg!r} is neither a file nor a shipped recipe; shipped: {', '.join(shipped)} "
                      "(`megazoo recipes` lists them with a description)")


def describe(path: Path, width: int = 100) -> str:
    """One line about a recipe: the first sentence of its opening comment, cut at a word before `width`."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break
        words += text.lstrip("#").split()
    sentence = ""
    for word in words:
        sentence += (" " if sentence else "") + word
        if word.endswith(".") and not word.endswith("..."):
            break
    if len(sentence) > width:
        sentence = sentence[:width - 3].rsplit(" ", 1)[0] + "..."
    return sentence


def stated_gpu(recipe: str | Path) -> str | None:
    """The GPU a recipe's header names, as `plan --gpu` takes it: a known part ("# Target cluster: 256 V100-32GB"
    -> "v100-32gb", recipes/gpus.py's key) or a size ("on 8 x 80 GB GPUs" -> "80"), else None. `recipe` is a file
    or a shipped recipe's name. `plan --recipe` and `plan --dry-run` default their --gpu to it."""
    try:
        path = find_recipe(str(recipe))
    except RecipeError:
        return None
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break  # the opening comment only
        header.append(line)
    text = " ".join(header)
    if found := re.search(r"Target cluster:.*?\b([AHV]\d{3})-(\d+)GB", text):
        return f"{found.group(1).lower()}-{found.group(2)}gb"
    found = re.search(r"\b(\d+) GB GPUs?\b", text)
    return found.group(1) if found else None
