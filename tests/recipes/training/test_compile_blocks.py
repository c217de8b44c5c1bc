"""train.compile = "blocks" (recipes/training/model_setup.compile_blocks): every block's forward and backward
through torch.compile, the losses those of the eager run.

The training test compiles with backend "aot_eager" (Dynamo's capture and AOTAutograd's backward, the graphs
run as captured): Inductor's cold code generation (C++ and g++) costs minutes of CPU here, far over the suite's
budget; benchmarks/compile.py runs Inductor (its losses and speed are in the README / notes). In fp64 the
captured graphs run the eager step's aten ops in the eager order, so the losses are held to 1e-12 relative:
any tracing error (a wrong saved tensor, a dropped autograd formula, a stale guard reusing another block's
parameters) is orders of magnitude larger.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.resolve import RecipeError, resolve
from megazoo.recipes.training.trainer import Trainer


def _losses(compile_mode: str, steps: int = 3, topo: Topology | None = None, **train) -> tuple[list[float], Trainer]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graph and break counts of this run only
    tp = topo.tp if topo is not None else 1
    res = tiny_resolved(train={"compile": compile_mode, "steps": steps, **train}, zero={"stage": 1},
                        parallel={"tp": tp})
    trainer = Trainer(res, topo or Topology.solo())
    return [trainer.train_step(i)["loss"] for i in range(steps)], trainer


def test_compiled_blocks_train_with_the_eager_losses():
    eager, _ = _losses("none")
    compiled, trainer = _losses("blocks:aot_eager")
    assert compiled == pytest.approx(eager, rel=1e-12, abs=0)
    blocks = [b for chunk in trainer.chunks for b in chunk.h.values()]
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)  # nn.Module.compile, in place
    # one graph for all the blocks (same shapes; parameters are graph inputs) and no graph break inside a block
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_unknown_compile_mode_is_rejected_naming_the_field():
    with pytest.raises(RecipeError, match=r"train.compile = 'fast' is invalid; valid: 'none', 'blocks', "
                                          r"'blocks:aot_eager'"):
        resolve(tiny_recipe(train={"compile": "fast"}))


def test_compiled_blocks_with_activation_checkpointing_train_with_the_eager_losses():
    """Each block runs compiled inside torch.utils.checkpoint (non-reentrant): the forward without saving, the
    recomputation in backward through the same compiled graph."""
    eager, _ = _losses("none", activation_checkpointing=True)
    compiled, _ = _losses("blocks:aot_eager", activation_checkpointing=True)
    assert compiled == pytest.approx(eager, rel=1e-12, abs=0)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def _tp2_losses():
    """Eager and compiled losses on this tp rank (gloo), and the graph breaks of the compiled run."""
    topo = Topology.build(dp=1, tp=2)
    eager, _ = _losses("none", topo=topo)
    compiled, _ = _losses("blocks:aot_eager", topo=topo)
    return eager, compiled, dict(torch._dynamo.utils.counters["graph_break"])


def test_compiled_blocks_with_tensor_parallelism_train_with_the_eager_losses():
    """tp 2: the blocks' column/row-parallel layers and their all-reduces (parallel/tensor/comms.py, autograd
    Functions around torch.distributed calls) inside the compiled blocks."""
    results = run_distributed(_tp2_losses, 2)
    for eager, compiled, breaks in results:
        assert compiled == pytest.approx(eager, rel=1e-12, abs=0)
    assert results[0][1] == results[1][1]  # both tp ranks see the same loss
    print("graph breaks with tp 2:", results[0][2])
