"""`checkpoint.format = "dcp"` (issue 39 item 4): a run saves torch.distributed.checkpoint files and resumes from
them in another layout, resharded by DCP's own planner: saved at dp 2 x tp 2 under ZeRO-3 (4 gloo ranks), continued
at dp 1 / tp 1 and at tp 2, the continued run equals the uninterrupted single-process reference (losses, gradient
norms, parameters). The folder is a plain DCP checkpoint (torch's dcp.load reads its tensors at the model's shapes),
published with the manifest every checkpoint has, and `megazoo convert megazoo-to-hf` reads it. The rectangles a
view is cut into tile exactly its elements, for every tp layout and flat range (view_chunks)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import run_distributed
from parity_helpers import assert_same_training
from recipe_helpers import tiny_resolved

from megazoo.parallel.checkpoint.consolidate import read_full_state
from megazoo.parallel.checkpoint.dcp_views import view_chunks
from megazoo.parallel.checkpoint.io import CheckpointError, verify_checkpoint
from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.tensor import ShardSpec, shard_of
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.training.trainer import Trainer

SAVE_AT = 4


@pytest.mark.parametrize("shape, dim, sections", [((12, 8), 0, 3), ((12, 8), 1, 1), ((12,), 0, 3),
                                                  ((12, 8), None, 1), ((6, 4, 4), 2, 2)])
def test_view_chunks_tile_the_views_elements(shape, dim, sections):
    rng = random.Random(0)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    for size in (1, 2) if dim is not None else (1,):
        for rank in range(size):
            spec = ShardSpec(shape, dim, sections, rank, size)
            local = shard_of(full, spec).view(-1)
            for _ in range(25):
                s = rng.randrange(local.numel())
                e = rng.randrange(s + 1, local.numel() + 1)
                got = torch.full(shape, -1.0, dtype=torch.float64)
                for offsets, sizes, tensor in view_chunks(StateView("x", spec, "param", s, e, local[s:e].clone())):
                    box = tuple(slice(o, o + z) for o, z in zip(offsets, sizes))
                    assert (got[box] == -1).all()  # no element twice
                    got[box] = tensor
                assert int((got != -1).sum()) == e - s and torch.equal(got[got != -1], full[got != -1])


def _recipe(par: dict, zero: dict, run_dir: str, **checkpoint):
    dp = par.get("dp", 1)
    return tiny_resolved(parallel=par, train={"steps": 8, "micro_batch": 8 // dp}, zero=zero, run={"dir": run_dir},
                         model={"n_layer": 2}, checkpoint={"format": "dcp", **checkpoint})


def _train_and_save(par: dict, zero: dict, run_dir: str):
    trainer = Trainer(_recipe(par, zero, run_dir), Topology.of(_recipe(par, zero, run_dir).recipe.parallel))
    for step in range(SAVE_AT):
        trainer.train_step(step)
    trainer.save_checkpoint(SAVE_AT)


def _continue_from(par: dict, zero: dict, source: str, run_dir: str):
    res = _recipe(par, zero, run_dir)
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    start = trainer.load_checkpoint(source)
    result = trainer.fit(start_step=start)
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict(), "start": start}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """4 steps at dp 2 x tp 2 under ZeRO-3 saved as DCP; the uninterrupted single-process run of 8 steps."""
    root = tmp_path_factory.mktemp("dcp-run")
    run_distributed(_train_and_save, 4, {"dp": 2, "tp": 2}, {"stage": 3}, str(root / "run"))
    reference = Trainer(_recipe({}, {}, str(root / "ref")), Topology.solo())
    result = reference.fit()
    ref = {"losses": result.losses[SAVE_AT:], "norms": result.grad_norms[SAVE_AT:], "val": result.val_loss,
           "params": reference.full_state_dict()}
    return root / "run" / "checkpoints" / f"step_{SAVE_AT:08d}", ref


def test_the_checkpoint_is_a_dcp_folder_with_a_manifest(saved):
    path, ref = saved
    manifest = verify_checkpoint(path)  # every DCP file's size and sha256 recorded, as for the native format
    assert manifest["storage"] == "dcp" and manifest["pieces"] == []
    assert ".metadata" in manifest["files"] and sum(f.endswith(".distcp") for f in manifest["files"]) == 4
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    kinds = {key.split("/", 1)[0] for key in metadata}
    assert kinds == {"param", "exp_avg", "exp_avg_sq"} or kinds == {"param", "master", "exp_avg", "exp_avg_sq"}
    wte = torch.empty(tuple(metadata["param/wte.weight"].size), dtype=torch.float64)
    dcp.load({"param/wte.weight": wte}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert wte.shape == (300, 128)  # the real vocabulary, not the tp-padded one
    model, state = read_full_state(path)  # what megazoo-to-hf reads
    assert torch.equal(state["wte.weight"], wte.float())


@pytest.mark.parametrize("par, zero", [({}, {}), ({"tp": 2}, {"stage": 1})], ids=["dp1-tp1", "tp2"])
def test_resumes_resharded_at_another_layout(tmp_path, saved, par, zero):
    path, ref = saved
    world = par.get("tp", 1)
    results = run_distributed(_continue_from, world, par, zero, str(path), str(tmp_path)) if world > 1 \
        else [_continue_from(par, zero, str(path), str(tmp_path))]
    for got in results:
        assert got.pop("start") == SAVE_AT
        assert_same_training(got, ref)


def test_a_damaged_dcp_checkpoint_is_refused(tmp_path, saved):
    import shutil

    path, _ = saved
    copy = shutil.copytree(path, tmp_path / "step_00000004")
    data = sorted(copy.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=f"{data.name} is truncated"):
        verify_checkpoint(copy)
    with pytest.raises(RecipeError, match="checkpoint.format = 'zarr' is invalid"):
        _recipe({}, {}, str(tmp_path), **{"format": "zarr"})
    with pytest.raises(RecipeError, match="async_save"):
        _recipe({}, {}, str(tmp_path), async_save=True)


def _bf16_save(run_dir: str):
    res = tiny_resolved(parallel={"dp": 2, "pp": 2}, train={"steps": 8, "micro_batch": 4, "precision": "bf16"},
                        zero={"stage": 1}, run={"dir": run_dir}, model={"n_layer": 2}, checkpoint={"format": "dcp"})
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    for step in range(2):
        trainer.train_step(step)
    trainer.save_checkpoint(2)
    return trainer.full_state_dict()


def test_bf16_parameters_and_fp32_masters_reshard(tmp_path):
    """bf16 parameters and fp32 masters saved at dp 2 x pp 2 (ZeRO-1: masters partitioned) load at one rank (ZeRO-1,
    bf16 parameters): the parameters are the saved ones bit for bit and round from the stored fp32 masters."""
    saved = run_distributed(_bf16_save, 4, str(tmp_path / "run"))[0]
    path = tmp_path / "run" / "checkpoints" / "step_00000002"
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert metadata["master/wte.weight"].properties.dtype == torch.float32
    assert metadata["param/wte.weight"].properties.dtype == torch.bfloat16
    res = tiny_resolved(train={"steps": 8, "micro_batch": 8, "precision": "bf16"}, zero={"stage": 1},
                        run={"dir": str(tmp_path / "solo")}, model={"n_layer": 2}, checkpoint={"format": "dcp"})
    trainer = Trainer(res, Topology.solo())
    assert trainer.load_checkpoint(str(path)) == 2
    loaded = trainer.full_state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    master = torch.empty(tuple(metadata["master/h.1.mlp.c_fc.weight"].size), dtype=torch.float32)
    dcp.load({"master/h.1.mlp.c_fc.weight": master}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert torch.equal(master.to(torch.bfloat16), loaded["h.1.mlp.c_fc.weight"])
