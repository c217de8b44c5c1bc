"""One helper per job, and light package imports: the plain all-reduce (parallel/collectives.py) under every
tensor-parallel collective, the tokenizer loader above the tokenizer modules (no import circle), and a ZeRO
package whose __init__ loads nothing until asked."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from megazoo.parallel.collectives import all_reduce

REPO = Path(__file__).resolve().parents[2]


def _calls(path: Path) -> set[str]:
    return {ast.unparse(node.func) for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)}


@pytest.mark.parametrize("source", ["kernels/cross_entropy.py", "parallel/tensor/cross_entropy.py",
                                    "parallel/tensor/comms.py"])
def test_tensor_parallel_all_reduces_go_through_the_one_helper(source):
    calls = _calls(REPO / source)
    assert "all_reduce" in calls and not {"dist.all_reduce", "_all_reduce"} & calls


def _sum_over_two_ranks():
    from megazoo.parallel.topology import Topology

    topo = Topology.build(dp=2)
    x = torch.tensor([1.0 + topo.rank, 10.0])
    same = all_reduce(x, topo.dp_group)
    peak = all_reduce(torch.tensor([float(topo.rank)]), topo.dp_group, dist.ReduceOp.MAX)
    return same is x, x.tolist(), peak.item()


def test_all_reduce_is_in_place_and_returns_its_tensor():
    x = torch.ones(3)
    assert all_reduce(x, None) is x and x.tolist() == [1.0, 1.0, 1.0]  # no group: nothing to do
    assert run_distributed(_sum_over_two_ranks, 2) == [(True, [3.0, 20.0], 1.0)] * 2


def _top_level_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_tokenizer_loader_sits_above_the_tokenizers():
    for name in ("tokenizer", "gpt2_bpe", "sentencepiece_tokenizer"):
        imports = {m for path in [REPO / "data" / "tokenizers" / f"{name}.py"] for node in ast.walk(ast.parse(path.read_text()))
                   for m in ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])}
        assert "megazoo.data.tokenizers.loading" not in imports, name
    assert {"megazoo.data.tokenizers.gpt2_bpe", "megazoo.data.tokenizers.sentencepiece_tokenizer", "megazoo.data.tokenizers.tokenizer"} <= \
        _top_level_imports(REPO / "data" / "tokenizers" / "loading.py")
    # No re-export of the loader, not even a lazy one: nothing below the loader reaches it by any path.
    import megazoo.data.tokenizers.tokenizer as tokenizer

    for name in ("load_tokenizer", "check_tokenizer_spec", "load_hf_tokenizer"):
        assert not hasattr(tokenizer, name), name
    assert "importlib" not in (REPO / "data" / "tokenizers" / "tokenizer.py").read_text()


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("first", ["megazoo.data.tokenizers.gpt2_bpe", "megazoo.data.tokenizers.sentencepiece_tokenizer",
                                   "megazoo.data.tokenizers.loading", "megazoo.data.tokenizers.tokenizer"])
def test_every_tokenizer_module_imports_first(first):
    assert _fresh(f"import {first}; from megazoo.data.tokenizers.loading import load_tokenizer; print('ok')") == "ok"


def test_importing_one_zero_piece_does_not_load_the_engine():
    loaded = _fresh("import sys, megazoo.parallel.zero.stage12, megazoo.recipes.planner.zero\n"
                    "print('megazoo.parallel.zero.api' in sys.modules)")
    assert loaded == "False"
    assert _fresh("from megazoo.parallel.zero import ZeroEngine, default_units\n"
                  "from megazoo.parallel.zero import api\n"
                  "print(ZeroEngine is api.ZeroEngine and default_units is api.default_units)") == "True"
    import megazoo.parallel.zero as zero

    with pytest.raises(AttributeError, match="no_such_name"):
        zero.no_such_name  # noqa: B018
