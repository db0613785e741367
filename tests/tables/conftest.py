"""The trained tiny table that the training, aggregation and PTQ tests share (xdist group
`support.TRAINED_TABLE`): trained once, through every path a table driver takes."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from tests.tables import support
from trace_jax.rl import evaluate
from trace_jax.tables.grid import Table
from trace_jax.tables.train import finished_seeds, run_sft_stage, train_runs


@dataclasses.dataclass
class TrainedTable:
    """table, workdir, and what each driver call did on the way: `deadline_passed` (train_runs'
    result with a deadline already passed), `dirs_after_deadline`, `shard1` (the (label, seed)
    pairs finished after worker 1 of 2), `all_done` (the final call's result)."""

    table: Table
    workdir: pathlib.Path
    deadline_passed: bool
    dirs_after_deadline: list[str]
    shard1: set[tuple[str, int]]
    all_done: bool


@pytest.fixture(scope="session")
def trained_table(tmp_path_factory) -> TrainedTable:
    table = Table.from_config_dict(support.table_config())
    work = tmp_path_factory.mktemp("table")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluate, "evaluate_pass_at_1", support.fake_pass_at_1)
        run_sft_stage(table, str(work))
        # A deadline already passed: no RL chunk starts.
        deadline_passed = train_runs(table, str(work), deadline_s=0.0)
        dirs = sorted(p.name for p in work.iterdir())
        # Two workers split the four (run, seed) pairs.
        train_runs(table, str(work), shard=(1, 2))
        shard1 = {(lb, s) for lb in table.labels for s in finished_seeds(table, str(work), lb)}
        train_runs(table, str(work), shard=(0, 2))
        all_done = train_runs(table, str(work))  # nothing left: returns at once
    return TrainedTable(table, work, deadline_passed, dirs, shard1, all_done)
