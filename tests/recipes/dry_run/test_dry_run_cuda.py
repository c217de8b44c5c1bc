"""The dry run on fake CUDA (recipes/dry_run/cuda.py): the real step on device "cuda" with no GPU.

One fresh interpreter with the fake CUDA shim runs every job below (its start-up is paid once); each job's report
is held against the CPU dry run of the same recipe and rank, run here: the same collectives op by op (dp and tp
bytes), and peaks within the planner's tolerance (10%) of each other (ZeRO-Offload: the device / host split and
one blocking copy each way instead). A planted bug - a CPU tensor added inside a CUDA step - is caught on fake
CUDA and passes unseen on the CPU. The shim's refusals name their reason.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megazoo.parallel.simulation import fake_cuda
from megazoo.parallel.simulation.fake_cuda import FakeCudaUnavailable, check_torch
from megazoo.recipes.dry_run.run import load, roles, run_role
from megazoo.recipes.dry_run.cuda import run_jobs
from megazoo.recipes.dry_run.report import report
from dry_run_helpers import cpu_tensor_in_the_mlp, tiny_dry_recipe

CONFIGS = {  # name -> _recipe keyword arguments
    "dp2-zero0-bf16": dict(stage=0, precision="bf16"),
    "dp2-zero1-bf16": dict(stage=1, precision="bf16"),
    "dp2-zero2-bf16": dict(stage=2, precision="bf16"),
    "dp2-zero3-bf16": dict(stage=3, precision="bf16"),
    "dp2-zero1-fp16": dict(stage=1, precision="fp16"),
    "dp2-zero2-fp16-offload": dict(stage=2, precision="fp16", extra='[zero]\noffload = "cpu"'),
    "tp2-zero1-bf16": dict(dp=1, tp=2, stage=1, precision="bf16"),
    "pp2-zero1-bf16": dict(dp=1, pp=2, stage=1, precision="bf16"),
}
# The child process imports the planted bug by "module:function" (from the repository root, tests/ as a namespace)
INJECTED = "tests.dry_run_helpers:cpu_tensor_in_the_mlp"


def _path(tmp_path, name):
    kwargs = dict(CONFIGS[name])
    extra = kwargs.pop("extra", "")
    folder = tmp_path / name
    folder.mkdir()
    path = tiny_dry_recipe(folder, **kwargs)
    if extra:  # the [zero] table exists already: add the key to it
        path.write_text(path.read_text().replace("[zero]\n", extra + "\n", 1))
    return path


@pytest.fixture(scope="module")
def fake_cuda_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fake-cuda")
    paths = {name: _path(tmp, name) for name in CONFIGS}
    jobs = [{"recipe": str(p), "gpu_memory_gb": 80} for p in paths.values()]
    jobs.append({"recipe": str(paths["dp2-zero1-bf16"]), "gpu_memory_gb": 80, "inject": INJECTED})
    reports = run_jobs(jobs)  # the machine's shim cache: built once per source and torch, not once per session
    return paths, dict(zip(CONFIGS, reports)), reports[-1]


def _cpu_report(path):
    res = load(path)
    return report(res, [run_role(res, role) for role in roles(res)], 80, 0.0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fake_cuda_step_matches_the_cpu_dry_run(fake_cuda_runs, name):
    paths, cuda_reports, _ = fake_cuda_runs
    cuda, cpu = cuda_reports[name], _cpu_report(paths[name])
    assert "error" not in cuda, cuda.get("error")
    assert cuda["device"].startswith("cuda") and cuda["world_size"] == cpu["world_size"]
    for fake, host in zip(cuda["roles"], cpu["roles"], strict=True):
        assert fake["rank"] == host["rank"]
        # dp and tp bytes, op by op: equal only since LayerNorm returns its input's dtype under CUDA autocast
        # (tp2 measured 886,300 all-reduce bytes in fp32 before, 591,388 after: the CPU's); 16-bit tp bytes
        assert fake["collectives"] == host["collectives"], name
        # Activations: the CPU's, since a 16-bit LayerNorm input runs outside CUDA autocast (kernels/layer_norm.py
        # layer_norm_outside_autocast). Before, autocast ran it in fp32 and kept an fp32 copy of each input
        # (dp2-zero1-bf16 1,257,984 B vs the CPU's 1,105,200: +152,784 B; tp2 +135,056; pp2's last stage +75,984).
        # After, 7-14 kB over, all of it the GPU's own: the caching allocator's 512-byte blocks (dp2-zero1-bf16:
        # 11,376 of its 13,520 B; with PYTORCH_NO_CUDA_MEMORY_CACHING=1 the gap is 2,144 B), the statistics in
        # fp32 (the CPU's kernel keeps a bf16 input's in bf16: 2,048 B) and flash attention's philox seed and
        # offset (24 B per layer).
        acts = fake["by_category"]["activations"], host["by_category"]["activations"]
        # Offload: the CPU dry run's one device also holds the host's optimizer states, so its peak falls at another
        # moment of the backward than on fake CUDA (since ZeRO-2's pool frees its spare buckets before each backward,
        # fake CUDA 922,112 B vs the CPU's 891,952: +3.4%); the other configs peak at the same moment.
        slack = 0.05 * acts[1] if "offload" in name else 16 * 1024
        assert acts[1] <= acts[0] <= acts[1] + slack, (name, acts)
        assert fake["dp_ring_bytes"] == host["dp_ring_bytes"]
        # FLOPs: CUDA's flash attention has torch's own formula (the CPU kernel, fake_world's): both the formula's
        assert abs(fake["flops"] - fake["formula_flops"]) <= 0.02 * fake["formula_flops"]
        # Offload too since its reduce-scatter outputs go back to the pool once their copy to the host is queued
        # (they stayed on the device to the step's end: +23% before, +4% after).
        assert abs(fake["measured_peak_bytes"] - host["measured_peak_bytes"]) <= \
            0.10 * host["measured_peak_bytes"], (name, fake["by_category"], host["by_category"])
    stubbed = {row["call"]: row for row in cuda["not_executed"]}
    assert {"get_rng_state", "manual_seed", "event", "reset_peak_memory_stats", "device_name"} <= set(stubbed)
    assert all(row["count"] > 0 and row["kind"] and row["answer"] for row in cuda["not_executed"])
    assert not cpu["roles"][0]["copies"]  # the CPU dry run has no device: no host <-> device copy at all


def test_offload_on_fake_cuda_splits_device_and_host_and_blocks_once_each_way(fake_cuda_runs):
    paths, cuda_reports, _ = fake_cuda_runs
    name = "dp2-zero2-fp16-offload"
    cuda, cpu = cuda_reports[name], _cpu_report(paths[name])
    fake, host = cuda["roles"][0], cpu["roles"][0]
    stubbed = {row["call"] for row in cuda["not_executed"]}
    assert {"host_register", "pinned_empty"} <= stubbed  # masters/moments registered, staging pinned on a GPU
    # The device peak holds no host memory (it added the host's staging and states before: 5.10 MB vs 4.91 MB),
    # and the host's peak holds at least the offloaded states the CPU dry run counts.
    assert fake["by_category"]["optimizer"] == 0 and fake["host_bytes"] >= host["host_bytes"] > 0
    # One blocking copy each way per step: the norm's two sums up, the clipping factor down (it was one per
    # bucket: 19 each way for this recipe's 19 buckets, and every fp32 gradient went up for the norm).
    h2d, d2h = fake["copies"]["host_to_device"], fake["copies"]["device_to_host"]
    assert h2d[2] == 1 and d2h[2] == 1, fake["copies"]
    # Up: the updated fp16 parameters and a few scalars - no longer every fp32 gradient (2.0x params before).
    assert h2d[1] < 1.1 * fake["by_category"]["params"], fake["copies"]


def test_a_cpu_tensor_in_a_cuda_step_is_caught(fake_cuda_runs, tmp_path):
    _, _, injected = fake_cuda_runs
    assert "error" in injected and "cpu" in injected["error"].lower() and "cuda" in injected["error"].lower()
    # The CPU dry run cannot see it: every tensor is on the CPU there.
    path = tiny_dry_recipe(tmp_path, stage=1, precision="bf16")
    res = load(path)
    with cpu_tensor_in_the_mlp():
        assert run_role(res, roles(res)[0]).measured.flops > 0


def test_the_shim_refuses_another_torch_and_a_cuda_build():
    with pytest.raises(FakeCudaUnavailable, match=r"pinned to torch 2\.13\.0.*this is torch 2\.14\.1"):
        check_torch("2.14.1+cpu", None)
    with pytest.raises(FakeCudaUnavailable, match=r"CUDA build \(CUDA 12\.8\)"):
        check_torch("2.13.0+cu128", "12.8")
    check_torch("2.13.0+cpu", None)


def test_the_shim_refuses_a_loaded_torch_and_a_missing_compiler(monkeypatch, tmp_path):
    with pytest.raises(FakeCudaUnavailable, match="already imported"):
        fake_cuda.load_shim(tmp_path / "never-loaded.so")  # this interpreter has torch: too late for the hooks
    monkeypatch.setattr(fake_cuda.shutil, "which", lambda name: None)
    with pytest.raises(FakeCudaUnavailable, match=r"g\+\+ is not on PATH"):
        fake_cuda.build_shim(tmp_path)


def test_cli_device_cuda_refusal_exits_2_with_the_reason(tmp_path, monkeypatch, capsys):
    from megazoo.recipes.planner.cli import main as plan_main

    monkeypatch.setattr(fake_cuda.shutil, "which", lambda name: None)
    path = tiny_dry_recipe(tmp_path, stage=1)
    assert plan_main(["--recipe", str(path), "--dry-run", "--gpu-memory", "32", "--device", "cuda"]) == 2
    assert "--device cuda: g++ is not on PATH" in capsys.readouterr().err


def test_a_shim_built_for_another_torch_folder_is_not_reused(monkeypatch, tmp_path):
    # CI once loaded a cached shim whose RUNPATH named a deleted virtualenv's torch/lib ("libc10.so: cannot open").
    built = []

    def fake_gxx(cmd, **kwargs):
        out = Path(cmd[cmd.index("-o") + 1])
        out.write_text(next(arg for arg in cmd if arg.startswith("-Wl,-rpath,")))
        built.append(out)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fake_cuda.shutil, "which", lambda name: "/usr/bin/g++")
    monkeypatch.setattr(fake_cuda.subprocess, "run", fake_gxx)
    shims = {}
    for venv in ("venv-a", "venv-b", "venv-a"):
        monkeypatch.setattr(fake_cuda, "_torch_dir", lambda venv=venv: tmp_path / venv / "torch")
        shims.setdefault(venv, set()).add(fake_cuda.build_shim(tmp_path / "cache"))
    assert len(built) == 2  # venv-a's second call is a cache hit
    assert len(shims["venv-a"]) == 1 and shims["venv-a"] != shims["venv-b"]
    for venv, (shim,) in shims.items():
        assert shim.read_text() == f"-Wl,-rpath,{tmp_path / venv / 'torch' / 'lib'}"


def test_concurrent_builds_of_one_shim_run_the_compiler_once(monkeypatch, tmp_path):
    """pytest-xdist workers (and two dry runs) asking at once: one g++ runs, the others wait on the cache's lock
    and take its file (under load the build took 17-46 s here, once per worker before)."""
    import threading
    import time

    calls = []

    def slow_gxx(cmd, **kwargs):
        calls.append(cmd)
        time.sleep(0.5)  # long enough for every other thread to reach the lock while this one builds
        Path(cmd[cmd.index("-o") + 1]).write_text("shim")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fake_cuda.shutil, "which", lambda name: "/usr/bin/g++")
    monkeypatch.setattr(fake_cuda.subprocess, "run", slow_gxx)
    shims = []
    threads = [threading.Thread(target=lambda: shims.append(fake_cuda.build_shim(tmp_path / "cache")))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(shims) == 4 and len(set(shims)) == 1 and shims[0].read_text() == "shim"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".build.lock", shims[0].name]  # no .tmp left
