"""A tensor-parallel command (`megazoo eval`, `eval harness`, `generate`) run the way its user started it.

`run_here_or_relaunch` is the one place these commands decide where they run: with --tp N > 1 the input is checked
in this process first (a bad flag, a damaged checkpoint or one missing a shard exits 2 before any worker starts,
as --tp 1 does), then N torchrun workers of the command's module take over (workers/local.py's tp_worker is their
entry); with --tp 1 the work runs here, on this process's device: the GPU of its node-local rank (LOCAL_RANK)
when CUDA exists, else the CPU (DESIGN principle 9; never "the first GPU when CUDA is available").

No torch at import: the command line imports this to build its parsers.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

# What bad input raises (a CheckpointError is a ValueError): exit 2 with one line, never a traceback.
INPUT_ERRORS = (FileNotFoundError, ValueError, ConnectionError)


def say(message: str) -> None:
    """A note for the user on stderr (stdout carries the command's result: generated text, a JSON record)."""
    print(message, file=sys.stderr, flush=True)


def verify_before_workers(args: Any, step_dir) -> None:
    """Under --tp N > 1, check every file of the checkpoint the workers will read (sizes and sha256) here, once:
    a missing or damaged shard exits 2 before any worker starts. With --tp 1 the load itself checks what it reads."""
    if processes(args) > 1:
        from megazoo.parallel.checkpoint.io import verify_checkpoint
        verify_checkpoint(step_dir)


EP_HELP = ("expert-parallel processes for an MoE model (x --tp of them, torchrun; default 1): each holds 1/E of "
           "every MoE layer's routed experts")


def check_ep(ep: int, cfg) -> None:
    """--ep E (an MoE model's commands): E expert-parallel processes, each holding n_experts / E of every MoE
    layer's routed experts. Checked before any worker starts, naming the value and what is valid."""
    if ep == 1:
        return
    if ep < 1:
        raise ValueError(f"--ep {ep} is invalid: it must be a positive integer (1: no expert parallelism)")
    if not cfg.is_moe:
        raise ValueError(f"--ep {ep} needs a mixture-of-experts model; {cfg.name} is dense (n_experts = 0): use --ep 1")
    if cfg.n_experts % ep:
        divisors = [d for d in range(1, cfg.n_experts + 1) if cfg.n_experts % d == 0]
        raise ValueError(f"--ep {ep} must divide the model's n_experts = {cfg.n_experts}; valid: "
                         f"{', '.join(map(str, divisors))}")


def processes(args: Any) -> int:
    """The command's worker count: --tp x --ep (the commands without --ep: --tp)."""
    return args.tp * getattr(args, "ep", 1)


def run_here_or_relaunch(args: Any, module: str, check: Callable[[Any], None],
                         forwarded_argv: Callable[[Any], Sequence[str]], work: Callable[[Any, Any], None]) -> int:
    """`check(args)` (it may pin args to what it resolved, e.g. the checkpoint's step directory, so that every
    worker reads the same one), then either relaunch `module` on args.tp local workers with `forwarded_argv(args)`
    or run `work(args, Topology.solo(device))` here. Exit status: the workers', 0, or 2 on bad input."""
    try:
        check(args)
        if processes(args) > 1:
            from megazoo.workers.supervisor import launch_local
            return launch_local(processes(args), module, list(forwarded_argv(args)))
        from megazoo.parallel.topology import Topology, local_device
        work(args, Topology.solo(local_device(int(os.environ.get("LOCAL_RANK", "0")))))
    except INPUT_ERRORS as error:
        print(f"megazoo: error: {error}", file=sys.stderr)
        return 2
    return 0
