"""One worker subprocess per item of a script's work, each pinned to a GPU, run concurrently.

`rl_step_time --gpus` (one method per GPU) and `ptq_table --gpus` (one seed per GPU, round
robin) re-run their own module with this run's flags plus a worker flag naming the item.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def worker_command(module: str, worker_flag: str, item, argv: Sequence[str]) -> list[str]:
    """`python -m <module> --<worker_flag>=<item>` with `argv`'s flags, less `--gpus` and any
    earlier worker flag."""
    keep = [a for a in argv[1:] if not a.startswith(("--gpus", f"--{worker_flag}"))]
    return [sys.executable, "-m", module, f"--{worker_flag}={item}", *keep]


def run_workers(
    module: str, worker_flag: str, items: Sequence, gpus: Sequence, argv: Sequence[str] = ()
) -> list:
    """Runs one worker per item, item k on GPU `gpus[k % len(gpus)]`, all at once; waits for
    them and returns the items whose worker failed.

    Workers allocate GPU memory on demand (unless the caller's environment says otherwise): with
    JAX's default preallocation of 75% of the GPU a second worker on the same GPU, or a job
    already running there, fails out of memory."""
    if not gpus:
        raise ValueError("run_workers needs at least one GPU")
    argv = argv or sys.argv
    procs = []
    for k, item in enumerate(items):
        env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[k % len(gpus)])
        procs.append(
            (item, subprocess.Popen(worker_command(module, worker_flag, item, argv), env=env))
        )
    return [item for item, p in procs if p.wait() != 0]
