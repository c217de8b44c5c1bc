"""Where a LoRA run's base lies (models/lora/checkpoint.py): the checkpoint.load its run recorded, relative to the
folder that run was started from (read off where its run.dir sits above the checkpoint, else its recorded
`workdir`), never the reader's folder; not there, the error names the recorded value and --lora-base."""

from __future__ import annotations

import pytest

from megazoo.models.lora.checkpoint import lora_base, lora_of_common, started_in


def _common(load="runs/demo/checkpoints", run_dir="runs/sft-demo", workdir=None, rank=8):
    common = {"recipe": {"checkpoint": {"load": load}, "run": {"dir": run_dir},
                         "lora": {"rank": rank, "alpha": 16.0, "targets": ["qkv"]}}}
    return {**common, "workdir": workdir} if workdir else common


def _tree(root):
    """root/runs/demo/checkpoints (the base) and root/runs/sft-demo/checkpoints/step_2 (the LoRA run)."""
    (root / "runs" / "demo" / "checkpoints").mkdir(parents=True)
    step = root / "runs" / "sft-demo" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    return step


def test_started_in_reads_the_folder_off_the_run_dir():
    step = "/work/a/runs/sft-demo/checkpoints/step_00000002"
    assert str(started_in(step, "runs/sft-demo")) == "/work/a"
    assert str(started_in(step, "./runs/sft-demo/")) == "/work/a"
    assert started_in(step, "runs/other") is None  # the checkpoint is not under that run.dir
    assert started_in(step, "/abs/run") is None and started_in(step, "") is None


def test_the_base_resolves_where_the_run_started_from_any_folder(tmp_path, monkeypatch):
    step = _tree(tmp_path / "work")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the reader's folder has no runs/demo
    assert lora_base(_common(), step) == tmp_path / "work" / "runs" / "demo" / "checkpoints"
    # the whole tree moved: read off the checkpoint's place, not the recorded (now stale) folder
    moved = tmp_path / "moved"
    (tmp_path / "work").rename(moved)
    step = moved / step.relative_to(tmp_path / "work")
    assert lora_base(_common(workdir=str(tmp_path / "work")), step) == moved / "runs" / "demo" / "checkpoints"
    # an absolute run.dir: the working folder the run recorded
    assert lora_base(_common(run_dir="/x/y", workdir=str(moved)), step) == moved / "runs" / "demo" / "checkpoints"
    # --lora-base wins, as given
    assert lora_base(_common(), step, given=str(moved / "runs" / "demo")) == moved / "runs" / "demo"
    assert lora_of_common(_common()).rank == 8 and lora_of_common(_common(rank=0)) is None


def test_a_missing_base_names_the_recorded_value_and_the_flag(tmp_path, monkeypatch):
    step = _tree(tmp_path / "work")
    (tmp_path / "work" / "runs" / "demo" / "checkpoints").rmdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        lora_base(_common(), step)
    message = str(error.value)
    assert "'runs/demo/checkpoints'" in message and "what its run recorded, checkpoint.load = " in message
    assert str(tmp_path / "work" / "runs" / "demo" / "checkpoints") in message and "--lora-base" in message
    with pytest.raises(FileNotFoundError, match="--lora-base /nowhere: no such checkpoint"):
        lora_base(_common(), step, given="/nowhere")
    with pytest.raises(ValueError, match="names no checkpoint.load.*--lora-base"):
        lora_base(_common(load=""), step)
