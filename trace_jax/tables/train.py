"""Training a table: the SFT warm start once, then every (run, seed) in resumable chunks.

Each chunk is `RLLoop(config, run_dir).run(stop_after=chunk_steps)`: it resumes from the run's
last checkpoint, so a stopped driver (a deadline, a lost machine) continues where it was. A run
is finished once its final evaluation (at step `steps - 1`) is in its `rl_eval.jsonl`. Each run
records the SFT stage it started from (`record_start`: its evaluation and fingerprint), since
GPU SFT stages of one config on two machines differ in their bits.
Evaluations are read with the current split names, also from logs written under older ones
(`trace_jax.tasks.splits.RENAMED_SPLITS`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence

from trace_jax.rl.loop import RLLoop
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sft import FINGERPRINT_KEY, SFT_EVAL, SFT_START, sft_or_reuse
from trace_jax.tables.grid import Table, run_dir, sft_dir
from trace_jax.tasks.splits import with_current_split_names

log = logging.getLogger(__name__)


def sft_checkpoint(workdir: str) -> str:
    """The table's SFT warm start, where every run starts."""
    return os.path.join(sft_dir(workdir), "sft_checkpoint")


def run_sft_stage(table: Table, workdir: str) -> tuple[list[dict], float]:
    """Runs (or reuses) the table's SFT stage in `<workdir>/sft`: (eval rows, seconds spent)."""
    return sft_or_reuse(table.experiment, sft_dir(workdir))


def record_start(directory: str, workdir: str) -> None:
    """Copies the table's SFT evaluation (`<workdir>/sft/sft_eval.json`: pass@1 rows and the
    parameters' fingerprint) into the run directory `directory` as `SFT_START`, unless the run
    has one: a run keeps the start it began from, also when resumed on another machine."""
    target = os.path.join(directory, SFT_START)
    if not os.path.exists(target):
        os.makedirs(directory, exist_ok=True)
        shutil.copyfile(os.path.join(sft_dir(workdir), SFT_EVAL), target)


def recorded_start(directory: str) -> dict | None:
    """The SFT evaluation the run in `directory` started from (`record_start`), or None for a
    run without the record (one trained before runs recorded their start)."""
    path = os.path.join(directory, SFT_START)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def start_fingerprint(directory: str) -> str | None:
    """The fingerprint of the SFT parameters the run in `directory` started from, or None."""
    start = recorded_start(directory)
    return None if start is None else start.get(FINGERPRINT_KEY)


def steps_done(directory: str) -> int:
    """GRPO steps logged in the run directory `directory` (0 before its first)."""
    rows = read_rows(os.path.join(directory, "rl_metrics.jsonl"), missing_ok=True)
    return len({r["step"] for r in rows})


def eval_rows(directory: str) -> list[dict]:
    """The run's evaluations (`rl_eval.jsonl` in the run directory `directory`: per evaluation
    step, `step` and pass@1 by split), under the current split names."""
    rows = read_rows(os.path.join(directory, "rl_eval.jsonl"), missing_ok=True)
    return [with_current_split_names(r) for r in rows]


def final_eval(directory: str, steps: int) -> dict | None:
    """The run's evaluation of its finished policy (at step `steps - 1`), or None."""
    rows = [r for r in eval_rows(directory) if r["step"] == steps - 1]
    return rows[-1] if rows else None


def finished_seeds(table: Table, workdir: str, label: str) -> list[int]:
    """The seeds of run `label` with a final evaluation under `workdir`."""
    steps = table.steps(label)
    return [s for s in table.seeds if final_eval(run_dir(workdir, label, s), steps) is not None]


def train_runs(
    table: Table,
    workdir: str,
    *,
    deadline_s: float | None = None,
    shard: tuple[int, int] = (0, 1),
    labels: Sequence[str] = (),
) -> bool:
    """Advances worker `shard`'s (run, seed) pairs (`Table.pairs`) to their end, chunk by chunk;
    returns True when they are all finished, False when `deadline_s` seconds passed first (no
    chunk starts after it). Runs (or reuses) the SFT stage first."""
    t0 = time.perf_counter()
    run_sft_stage(table, workdir)
    for label, seed in table.pairs(shard, labels):
        config = table.run_config(label, seed, sft_checkpoint(workdir))
        directory = run_dir(workdir, label, seed)
        while (done := steps_done(directory)) < config.rl.steps:
            if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                log.info("deadline reached; rerun to continue")
                return False
            log.info("%s seed %d: from step %d", label, seed, done)
            record_start(directory, workdir)
            RLLoop(config, directory).run(stop_after=table.chunk_steps or None)
    return True
