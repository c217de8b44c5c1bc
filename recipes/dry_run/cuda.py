"""`megazoo plan --recipe R --dry-run --device cuda`: the dry run's real training step on fake CUDA tensors.

The CPU dry run (recipes/dry_run/run.py) runs every CUDA-only branch on device "cpu", so they never execute:
autocast("cuda"), ZeRO-Offload's pinned staging and its device-to-host copies, the CUDA RNG streams, events, the
device's properties. Here the same step runs with fake tensors on device "cuda": the fake CUDA shim
(parallel/simulation/fake_cuda.py) gives a CPU build of torch a CUDA device guard and hooks, and every CUDA runtime call is
answered by parallel/simulation/fake_cuda_stubs.StubCuda and listed in the report as "not executed".

The shim must be loaded before torch is imported, so the step runs in a fresh interpreter (`run_jobs` starts it:
`python -c BOOT shim jobs.json out.json`, ~5 s of start-up) and hands back the report as JSON; this process (which
has torch already) builds the shim and prints. One child runs every job it is given, so tests pay the start once.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megazoo.parallel.simulation.fake_cuda import FakeCudaUnavailable, build_shim

REFUSED = 4  # the child's exit code when the shim would not load or pass its self-test (stderr says why)
BOOT = ("import sys\n"
        "from megazoo.parallel.simulation.fake_cuda import FakeCudaUnavailable, load_shim\n"
        "try:\n"
        "    load_shim(sys.argv[1])\n"
        "except FakeCudaUnavailable as err:\n"
        f"    print(err, file=sys.stderr); sys.exit({REFUSED})\n"
        "from megazoo.recipes.dry_run.cuda import child_main\n"
        "sys.exit(child_main(sys.argv[2], sys.argv[3]))\n")


def run_jobs(jobs: list[dict], cache_dir: Path | None = None, timeout_s: float = 3600) -> list[dict]:
    """Each job {"recipe": path, "sets": [overrides], "gpu_memory_gb": float, "also_cpu": bool} dry-run on fake
    CUDA: its report
    (recipes/dry_run/report.report's dict, plus "device" and "not_executed"), or {"error": message} when
    the step raised on fake CUDA (a device mismatch, say). FakeCudaUnavailable says why not, whether the shim
    cannot be built here or the child cannot load it."""
    shim = build_shim(cache_dir)
    with tempfile.TemporaryDirectory(prefix="megazoo-fake-cuda-") as tmp:
        jobs_path, out_path = Path(tmp) / "jobs.json", Path(tmp) / "reports.json"
        jobs_path.write_text(json.dumps(jobs))
        # Triton compiled, as on a GPU (TRITON_INTERPRET dropped): the fake device launches no kernel, our Triton
        # ops answer from their fake implementations, and `auto` then picks them as on a GPU (it never picks
        # interpreted Triton, which the CPU test suite turns on).
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", BOOT, str(shim), str(jobs_path), str(out_path)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
        if done.returncode == REFUSED:
            raise FakeCudaUnavailable(done.stderr.strip())
        if done.returncode != 0 or not out_path.is_file():
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the fake-CUDA dry run failed (exit {done.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


@contextlib.contextmanager
def _injected(target: str | None):
    """Tests only: "module:function", a context manager that plants a bug (a CPU tensor in the step) for the
    job's run, to show that the fake-CUDA step catches what the CPU dry run cannot."""
    if not target:
        yield
        return
    module, name = target.split(":")
    with getattr(importlib.import_module(module), name)():
        yield


def child_main(jobs_path: str, out_path: str) -> int:
    """In the interpreter with the shim loaded: run each job's dry run on fake CUDA and write the reports."""
    from megazoo.parallel.simulation.fake_cuda_stubs import StubCuda, fake_cuda
    from megazoo.recipes.dry_run.run import dry_run, fake_cuda_kernels, load
    from megazoo.recipes.dry_run.report import report

    reports = []
    for job in json.loads(Path(jobs_path).read_text()):
        res = load(job["recipe"], job.get("sets", []))
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            with fake_cuda(StubCuda()) as stub, _injected(job.get("inject")):
                results = dry_run(res, device="cuda")
        except Exception as err:  # noqa: BLE001 - the step failed on fake CUDA: the job's result says how
            reports.append({"error": f"{type(err).__name__}: {err}"})
            continue
        rep = report(res, results, job["gpu_memory_gb"], time.perf_counter() - start)
        rep["device"] = "cuda (fake: no driver, no kernels run)"
        rep["notes"] = rep["notes"] + fake_cuda_kernels(res)[1]
        rep["not_executed"] = stub.not_executed()
        if job.get("also_cpu"):  # the CPU dry run of the same recipe, in this process (tests: one start for both)
            start = time.perf_counter()
            rep["cpu"] = report(res, dry_run(res), job["gpu_memory_gb"], time.perf_counter() - start)
        rep["process_seconds"] = time.process_time() - cpu_start  # CPU time of the job (both runs): CI's budget
        reports.append(rep)
    Path(out_path).write_text(json.dumps(reports))
    return 0
