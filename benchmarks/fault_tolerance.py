"""A measured timeline of one failure of a fault-tolerant replica group (`[fault_tolerance]`, torchft).

    python -m benchmarks.fault_tolerance          # 2 groups x 1 rank (gloo, CPU), gpt2-tiny with GPT-2's vocabulary
    python -m benchmarks.fault_tolerance --ranks-per-group 2 --stage 2 --steps 300

`megazoo train` runs the recipe (the launcher starts the lighthouse and one torchrun per group); once group 1 has
trained `--kill-at` steps, one of its workers is SIGKILLed (its torchrun ends the group, the launcher restarts
it, it heals from group 0). From both groups' metrics.jsonl (wall-clock `time` per step) it prints, as JSON and a
markdown row: group 0's steps per second before the failure, while alone, and after the heal; the seconds from
the kill to the restarted group's heal, and the step it healed at; whether the groups ended bitwise equal is
what tests/parallel/fault_tolerance/ proves, this measures the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = """
[model]
preset = "gpt2-tiny"
n_layer = 2
dropout = 0.0
attn_dropout = 0.0
[parallel]
dp = {dp}
[zero]
stage = {stage}
[train]
steps = {steps}
micro_batch = 4
seq_len = 64
warmup_steps = 5
[data]
source = "synthetic"
synthetic_tokens = 200000
[logging]
progress = false
[sample]
tokens = 0
[checkpoint]
at_end = false
[fault_tolerance]
enabled = true
replica_groups = 2
"""


def _metrics(run_dir: Path, group: int) -> list[dict]:
    path = run_dir / f"group-{group}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _worker_pid(group: int, local_rank: int) -> int | None:
    """A training worker of `group` (torchrun's child: it has LOCAL_RANK; torchrun does not)."""
    want = {f"MEGAZOO_REPLICA_GROUP={group}".encode(), f"LOCAL_RANK={local_rank}".encode()}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                env = set(Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if want <= env:
                return int(entry.name)
    return None


def _tail(log, chars: int = 5000) -> str:
    log.flush()
    log.seek(0)
    return "\n".join(line for line in log.read().splitlines() if "[INFO]" not in line)[-chars:]


def _rate(lines: list[dict]) -> float | None:
    if len(lines) < 2:
        return None
    return (len(lines) - 1) / (lines[-1]["time"] - lines[0]["time"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks-per-group", type=int, default=1)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megazoo-ft-") as tmp:
        run_dir, recipe = Path(tmp) / "run", Path(tmp) / "ft.toml"
        recipe.write_text(RECIPE.format(dp=2 * args.ranks_per_group, stage=args.stage, steps=args.steps))
        # the job's log to a file, not a pipe: torchft logs every quorum, and a pipe nobody reads until the end
        # fills up and blocks the workers' writes (and with them the run)
        log = open(Path(tmp) / "job.log", "w+")
        job = subprocess.Popen([sys.executable, "-m", "megazoo.recipes.cli", "train", str(recipe),
                                "--set", f"run.dir={run_dir}"], stderr=log, stdout=log, text=True)
        while len(_metrics(run_dir, 1)) < args.kill_at:
            if job.poll() is not None:
                raise SystemExit(f"the job ended before step {args.kill_at}:\n{_tail(log)}")
            time.sleep(0.05)
        old = {_worker_pid(1, r) for r in range(args.ranks_per_group)}  # group 1's workers before the kill
        pid = _worker_pid(1, args.ranks_per_group - 1)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        respawned_at = None  # when the launcher's restart of group 1 has a worker process again
        while job.poll() is None and respawned_at is None:
            new = _worker_pid(1, 0)
            if new is not None and new not in old:
                respawned_at = time.time()
            time.sleep(0.2)  # /proc scans: cheap enough at this rate
        job.wait()
        err = _tail(log, 1 << 20)
        m0, m1 = _metrics(run_dir, 0), _metrics(run_dir, 1)
    healed = next((m for m in m1 if "healed_at_step" in m), None)
    if healed is None:  # the restart took longer than group 0's remaining steps: ask for more steps
        raise SystemExit(f"group 1 did not rejoin before group 0 finished {args.steps} steps: raise --steps\n{err}")
    before = [m for m in m0 if m["time"] < killed_at]
    alone = [m for m in m0 if m["replicas_live"] == 1]
    after = [m for m in m0 if m["step"] >= healed["healed_at_step"]]
    heal_line = next(m for m in m0 if m["step"] == healed["healed_at_step"])  # group 0's step that sent the state
    median_after = sorted(m["step_time_s"] for m in after[1:])[len(after[1:]) // 2] if len(after) > 1 else None
    out = {"ranks_per_group": args.ranks_per_group, "zero_stage": args.stage, "exit_code": job.returncode,
           "steps_per_s_before": _rate(before), "steps_per_s_alone": _rate(alone), "steps_per_s_after": _rate(after),
           "steps_alone": len(alone), "kill_to_heal_s": healed["time"] - killed_at,
           # the timeline: kill -> group 0's first step alone ends -> the restarted group has a process again ->
           # its first (healed) step ends; and what sending the state cost group 0's step
           "kill_to_first_step_alone_s": alone[0]["time"] - killed_at if alone else None,
           "kill_to_respawn_s": respawned_at - killed_at if respawned_at else None,
           "respawn_to_heal_s": healed["time"] - respawned_at if respawned_at else None,
           "heal_join_quorums": healed.get("join_quorums"),
           "group0_heal_step_s": heal_line["step_time_s"], "group0_heal_step_ft_wait_s": heal_line["ft_wait_s"],
           "group0_median_step_s_after": median_after,
           "healed_at_step": healed["healed_at_step"], "launcher": [l for l in err.splitlines() if l.startswith("megazoo:") and "replica group" in l],
           # the restarted group's lines from before the failure are kept (nothing on disk is lost)
           "group1_steps_kept_before_kill": sum(m["step"] < healed["healed_at_step"] for m in m1)}
    print(json.dumps(out, indent=1))
    print("| groups x ranks | steps/s before | alone | after heal | kill -> heal (s) | kill -> restarted process (s) "
          "| steps alone |")
    respawn = out["kill_to_respawn_s"]
    print(f"| 2 x {args.ranks_per_group} | {out['steps_per_s_before']:.2f} | {out['steps_per_s_alone']:.2f} | "
          f"{out['steps_per_s_after']:.2f} | {out['kill_to_heal_s']:.1f} | "
          f"{'-' if respawn is None else f'{respawn:.1f}'} | {out['steps_alone']} |")
    return out


if __name__ == "__main__":
    main()
