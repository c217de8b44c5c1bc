"""megazoo installs as one namespace (megazoo.data, megazoo.models, ...): a user's own `data/`, `models/` or
`kernels/` folder in the working directory (the README's `--output-prefix data/corpus` makes one) never shadows
it, on the launcher or on any torchrun worker (`python -m` puts the working directory first on sys.path)."""

from __future__ import annotations

import json
import subprocess
import sys

from jobs import write_recipe


def test_training_from_a_folder_holding_data_models_and_kernels(tmp_path):
    for name in ("data", "models", "kernels", "parallel", "recipes", "eval"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user folder {name}/ was imported')\n")
    write_recipe(tmp_path / "recipe.toml", tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", "train", "recipe.toml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "was imported" not in out.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
