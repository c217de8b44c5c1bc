"""`checkpoint.export_hf = DIR` (issue 39): a finished run writes its last checkpoint as an HF folder (streamed,
sharded, verified) that transformers loads with the run's logits; a non-empty DIR is refused before training."""

from __future__ import annotations

import torch
import transformers

from megazoo.parallel.checkpoint.consolidate import CheckpointReader
from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.models.config import ModelConfig
from megazoo.parallel.topology import Topology
from megazoo.recipes import train

RECIPE = '''[model]
preset = "gpt2-tiny"
n_layer = 1
vocab_size = 300
dropout = 0.0
attn_dropout = 0.0
[data]
source = "synthetic"
synthetic_tokens = 5000
[train]
steps = 2
micro_batch = 2
seq_len = 32
eval_every = 0
eval_batches = 1
[logging]
progress = false
[sample]
tokens = 0
[run]
dir = "{run}"
[checkpoint]
export_hf = "{out}"
'''


def test_a_finished_run_exports_a_verified_hf_folder(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(run=tmp_path / "run", out=tmp_path / "hf"))
    assert train.main([str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "logits (max abs difference)" in out and "FAIL" not in out
    reader = CheckpointReader(tmp_path / "run" / "checkpoints")
    cfg = ModelConfig(**reader.common["model"])
    ours = gpt_from_full_state(cfg, {n: reader.read(n) for n in reader.names()}, Topology.solo())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids)[..., :300], hf(ids).logits, atol=1e-5, rtol=0)


def test_a_non_empty_export_folder_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("kept")
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(run=tmp_path / "run", out=tmp_path / "hf"))
    assert train.main([str(recipe)]) == 2
    assert "checkpoint.export_hf" in capsys.readouterr().err and not (tmp_path / "run" / "checkpoints").exists()
