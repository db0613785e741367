"""The paper's tables as library code, on top of `trace_jax.rl` (which never imports this).

  table = Table.from_config_dict(cd)             # a table config: experiment + `table` section
  train_runs(table, workdir)                     # SFT once, then every (run, seed) in chunks
  rows = aggregate.aggregate(table, workdir)     # pass@1 mean +- std over seeds, from the logs

- `grid`: a table's runs x seeds (`Table`), run directories and configs, the benchmark average.
- `train`: the SFT stage and resumable training of a table's (run, seed) pairs.
- `aggregate`: mean +- std of the final evaluations, log statistics, adaptation, curves.
- `queue`, `bundle`: several tables' runs as detached jobs over one machine's GPUs; their logs
  packed into one tarball and unpacked into a results tree.
- `ptq_table` (Table 7), `step_time` (GRPO step time by phase), `site_mismatch` (code mismatch
  per layer and site), `gap` (the train-rollout gap per trainer mode).

Library code writes run state only (logs, checkpoints, per-seed row files); markdown, plots and
result files are the entry points' (`experiments/`).
"""

from trace_jax.tables.grid import (
    BENCHMARK_SPLITS,
    Table,
    benchmark_average,
    benchmark_splits,
    run_dir,
    table_section,
)
from trace_jax.tables.train import final_eval, finished_seeds, run_sft_stage, train_runs

__all__ = [
    "BENCHMARK_SPLITS",
    "Table",
    "benchmark_average",
    "benchmark_splits",
    "final_eval",
    "finished_seeds",
    "run_dir",
    "run_sft_stage",
    "table_section",
    "train_runs",
]
