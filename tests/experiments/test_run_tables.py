"""The table-queue entry point: table configs loaded as each job's `--config` reads them."""

from __future__ import annotations

import pytest

from experiments import run_tables
from trace_jax.tables.grid import Table
from trace_jax.tables.queue import Job


def test_load_table_applies_the_jobs_config_overrides():
    job = Job("configs/table5_layers.py", "table5_layers", "trace half", 1, 1, 3)
    extra = ["--config.rl.steps=4", "--config.rl.warmup_steps=1", "--config.rl.eval_every=2"]
    extra.append("--other_flag=1")
    argv = job.command("/r", run_tables.TABLE_DRIVER, extra)
    # What the job's entry point sees: its own `--config.*` flags and the extra ones.
    cd = run_tables.load_table(job.config_path, [a for a in argv if a.startswith("--config.")])
    table = Table.from_config_dict(cd)
    assert table.chunk_steps == 0 and table.steps("trace half") == 4
    assert table.run_config("trace half", 1).rl.eval_every == 2
    with pytest.raises(AttributeError, match="nope"):  # a locked config: no new fields
        run_tables.load_table(job.config_path, ["--config.rl.nope=1"])
