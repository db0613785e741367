r"""Paper tables on one GPU machine: their (run, seed) pairs as a queue of jobs on shared GPUs.

  python -m experiments.run_tables \
      --tables=configs/table1_nvfp4.py,configs/table4_mxfp4.py --root=/tmp/tables \
      --per_gpu=3 --deadline_s=1200 --bundle=$OUT/runs.tgz --done_from=experiments/results/runs
  python -m experiments.run_tables --unpack=runs.tgz --tag=<date>   # back on this machine

The SFT warm start runs once in `<root>/sft`; every unfinished (table, run, seed) is then a job
`python -m experiments.paper_table --runs=<label> --shard=<k>/<seeds>` on one of `gpus x
--per_gpu` slots, retried once on failure; no job starts after `--deadline_s`; runs two tables
share (the same training) are trained once and copied (`trace_jax.tables.queue`). `<root>/
queue.jsonl` logs every job's start and end. `--bundle` packs the run logs, SFT evaluation and
job logs (no checkpoints or guidance stores) into one tarball; `--unpack=runs.tgz --tag=<date>`
puts it into `experiments/results/runs/<table name>/` (`trace_jax.tables.bundle`); then
`paper_table --aggregate_only` (`--partial` while seeds are missing) writes each table.

`--done_from` adopts runs finished in an earlier invocation (another machine's, unpacked into
the results tree) instead of training them again. Each run records the SFT stage it started
from; once this invocation's SFT stage has run, a seed adopted whole from one start is kept, and
otherwise only the adopted runs that started from this stage's start (the rest of the seed trains
here), so the runs of a seed never mix two starts (`--adopt_other_starts` keeps them anyway).

`--extra` passes more flags to every job (`--config.*` overrides: the tests and CPU dry runs use
a tiny model). One `small` run leaves an H200 mostly idle. With `grouped_matmul="ragged_dot"`
(38 GiB train step) three runs per GPU took 1.0-1.7 s per GRPO step each and five ran out of
memory (`results/runs/table1_nvfp4/README.md`); with "auto" (`trace`, from random init) one run
alone takes 0.77 s per step, six per GPU 3.1-3.6 s each (1.8 steps/s in all), and nine ran out of
memory (141 GiB in use): N copies of `python -m experiments.rl_step_time
--config.step_time.methods=trace --config.step_time.steps=14 --config.step_time.skip=4` started
together on one GPU of an nvidia-h200-x2 host (six on GPU 0, nine on GPU 1), with on-demand GPU
memory.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from trace_jax.rl.logs import quiet_third_party
from trace_jax.tables.bundle import unpack_bundle
from trace_jax.tables.grid import Table
from trace_jax.tables.queue import run_tables

TABLE_DRIVER = "experiments.paper_table"


def load_table(path: str, extra: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The table config file at `path` with the `--config.*` overrides among `extra` applied,
    as each job's `--config` flag reads it."""
    argv = ["run_tables", f"--config={path}", *[a for a in extra if a.startswith("--config.")]]
    fv = flags.FlagValues()
    # config_flags registers the override flags it finds in `sys_argv` when the flag is defined.
    holder = config_flags.DEFINE_config_file(
        "config", path, flag_values=fv, sys_argv=argv, lock_config=True
    )
    fv(argv)
    return holder.value


def main(argv):
    del argv
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    if f.unpack:  # back from the GPU machine: the bundle into the results tree
        tables = unpack_bundle(f.unpack, f.unpack_to, f.tag)
        print(f"unpacked {tables} into {f.unpack_to}")
        return
    if not f.tables:
        raise app.UsageError("--tables is required (or --unpack)")
    extra = shlex.split(f.extra)
    codes = run_tables(
        [(path, Table.from_config_dict(load_table(path, extra))) for path in f.tables],
        module=TABLE_DRIVER,
        root=f.root,
        per_gpu=f.per_gpu,
        deadline_s=f.deadline_s or None,
        extra=extra,
        bundle_path=f.bundle,
        done_from=f.done_from,
        adopt_other_starts=f.adopt_other_starts,
        mem_fraction=f.mem_fraction,
    )
    failed = sorted(k for k, rc in codes.items() if rc)
    print(f"{len(codes) - len(failed)} jobs finished, {len(failed)} failed: {failed}")


if __name__ == "__main__":
    flags.DEFINE_list("tables", None, "table config files (they must share the SFT settings)")
    flags.DEFINE_string("root", "workdir/tables", "one workdir per table under it, SFT shared")
    flags.DEFINE_integer("per_gpu", 3, "runs sharing one GPU")
    flags.DEFINE_float("deadline_s", 0, "start no job after this many seconds (0: no deadline)")
    flags.DEFINE_string("extra", "", "more flags for every job (--config.* overrides)")
    flags.DEFINE_string("bundle", "", "write the run logs to this .tgz at the end")
    flags.DEFINE_float("mem_fraction", 0.0, "cap each job's GPU memory at this share (0: none)")
    flags.DEFINE_string("done_from", "", "logs of runs finished earlier (experiments/results/runs)")
    flags.DEFINE_bool(
        "adopt_other_starts", False, "keep adopted runs even where a seed would mix SFT starts"
    )
    flags.DEFINE_string("unpack", "", "a bundle to unpack into --unpack_to instead of running")
    flags.DEFINE_string("unpack_to", "experiments/results/runs", "where bundles are unpacked")
    flags.DEFINE_string("tag", "", "with --unpack: prefix of the unpacked logs (e.g. the date)")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")
    app.run(main)
