"""The recipes shipped with megazoo, reachable by name from any install: `megazoo train demo`, `megazoo recipes`.

The TOML files in recipes/ install as package data of `megazoo.recipes` (pyproject.toml's package-data), so a
wheel carries them. `find_recipe(arg)` turns what the user typed into a file: an existing path wins (a user's
own `demo.toml` in the current directory is theirs, not ours); otherwise a shipped name, with or without
".toml". The first sentence of each recipe's opening comment is its one-line description.
"""

from __future__ import annotations

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
