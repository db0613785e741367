r"""One paper-table analog: every (run, seed) of a table config, resumable, then mean +- std.

  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=workdir/table1
  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=workdir/table1 \
      --deadline_s=480        # stop starting new chunks after 8 min; rerun to continue

A table config is an experiment config plus a `table` section (`trace_jax.tables.grid`): name,
title, seeds, and runs, a list of (label, overrides) where overrides set `rl.*` fields (method,
format, guided layers, GRPO hyper-parameters). The driver
  1. runs the SFT warm start once (`<workdir>/sft`, reused when present);
  2. runs GRPO for every run and seed from that checkpoint (`<workdir>/<label>/seed<k>`, in chunks
     of `table.chunk_steps`; each chunk resumes from the last orbax checkpoint, so a stopped
     driver continues where it was);
  3. when every run is finished, reads each run's final evaluation and writes
     `<outdir>/<name>.{md,json,png}`: pass@1 per split (mean +- std over seeds), the average over
     the benchmark splits, and curves of reward, train-rollout gap and test score.
Nothing is aggregated from unfinished runs: an incomplete table says so and writes nothing.

Parallel workers (e.g. several per GPU: one `small` run leaves an H200 mostly idle): run the SFT
stage once (`--sft_only`), then start workers with `--shard=i/n`; worker i trains the (run, seed)
pairs i, i + n, ... of the table and skips finished ones. A plain run afterwards aggregates:

  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=w --sft_only
  for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$((i % 2)) python -m experiments.paper_table \
      --config=configs/table1_nvfp4.py --workdir=w --shard=$i/4 & done; wait
  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=w

`experiments.run_tables` schedules the pairs of several tables over a machine's GPUs this way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib
import numpy as np
from absl import app, flags

from experiments import harness
from trace_jax.rl.logs import quiet_third_party
from trace_jax.tables import aggregate as agg
from trace_jax.tables.grid import Table, benchmark_splits
from trace_jax.tables.train import run_sft_stage, train_runs
from trace_jax.tasks.splits import split_legend

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def parse_shard(spec: str) -> tuple[int, int]:
    """`"i/n"` -> (i, n) with 0 <= i < n; `""` -> (0, 1) (everything)."""
    if not spec:
        return 0, 1
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like i/n, got {spec!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {spec!r}: need 0 <= i < n")
    return i, n


def smooth(x: Sequence[float], window: int = 10) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    c = np.cumsum(np.insert(np.asarray(x, np.float64), 0, 0.0))
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def plot_adaptation(
    ax, adapt: dict, sft_scores: dict[str, float], colors: dict[str, str] | None = None
) -> None:
    """The adaptation curve on `ax`: `adapt`'s run and reference (mean, the reference's seed std
    as error bars) on the hardest split at every evaluation step, from each one's SFT score
    (step -1, under its own execution) when `sft_scores` (label -> score) has both; a dotted
    line where the run first matches. `colors`: label -> matplotlib color."""
    run, ref = adapt["run"], adapt["reference"]
    steps = [p["step"] for p in adapt["points"]]
    run_y = [p[run] for p in adapt["points"]]
    ref_y = [p[ref] for p in adapt["points"]]
    if run in sft_scores and ref in sft_scores:
        steps = [-1, *steps]
        run_y, ref_y = [sft_scores[run], *run_y], [sft_scores[ref], *ref_y]
    ref_err = [0.0] * (len(steps) - len(adapt["points"])) + [p["ref_std"] for p in adapt["points"]]
    colors = colors or {}
    ax.errorbar(
        steps, ref_y, yerr=ref_err, fmt="o-", capsize=3, color=colors.get(ref),
        label=f"{ref} (+- seed std)",
    )  # fmt: skip
    ax.plot(steps, run_y, "s-", color=colors.get(run), label=run)
    if adapt["matched_at"] is not None:
        ax.axvline(adapt["matched_at"], color="k", ls=":", lw=1)
    ax.legend(fontsize=7)
    ax.set(xlabel="RL step", title=f"hardest split `{adapt['split']}` (-1: SFT)")
    ax.grid(True, alpha=0.3)


def plot(table: Table, workdir: str, path: str, adapt: dict | None = None) -> None:
    """Curves over the finished seeds of every run: reward, train-rollout gap and KL (log
    scale), benchmark average pass@1 from the SFT start (FP4 runs' policies scored in bf16 as
    well: dashed), and the adaptation curve when there is one."""
    panels = 5 if adapt else 4
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.6))
    colors = {label: f"C{i}" for i, label in enumerate(table.labels)}
    starts = {label: agg.start_row(table, workdir, label) for label in table.labels}
    bf16_start = agg.sft_row(table, workdir)
    for c in agg.curves(table, workdir):
        color = colors[c["run"]]
        for ax, key in zip(axes[:3], agg.CURVE_KEYS, strict=True):
            if key in c:
                ax.plot(c["steps"], smooth(c[key]), color=color, label=c["run"])
        for key, start, style in (
            ("score", starts[c["run"]], "o-"),
            ("score_bf16", bf16_start, "s--"),
        ):
            if key not in c:
                continue
            steps, score = c["eval_steps"], c[key]
            if start is not None:  # the SFT policy under the curve's execution
                steps, score = [-1, *steps], [start["average"], *score]
            label = c["run"] if key == "score" else f"{c['run']} (in bf16)"
            axes[3].plot(steps, score, style, color=color, label=label)
    titles = (
        "mean reward (10-step avg)",
        "mean |logp train - rollout| (10-step avg)",
        "train-rollout KL k3 (10-step avg)",
        "test pass@1, benchmark avg (-1: SFT)",
    )
    for ax, title in zip(axes[:4], titles, strict=True):
        ax.set(xlabel="RL step", title=title)
        ax.grid(True, alpha=0.3)
    for ax in axes[1:3]:
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[3].legend(fontsize=6)
    if adapt:
        scores = {lb: r[adapt["split"]] for lb, r in starts.items() if r is not None}
        plot_adaptation(axes[4], adapt, scores, colors)
    fig.suptitle(f"{table.title}: mean over finished seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def notes(table: Table, workdir: str, rows: list[dict], adapt: dict | None, from_logs: bool):
    """The table's notes: settings, adaptation, shared runs, provenance, missing seeds."""
    e = table.experiment
    text = (
        f"{table.title}. Model `{table.base.model.preset}` ({e.model.n_layers} layers), SFT warm "
        f"start {e.sft.steps} steps, {e.rl.steps} GRPO steps of {e.rl.prompts_per_step} prompts x "
        f"{e.rl.grpo.group_size} samples; pass@1 with each run's own rollout execution (FP4 "
        "methods in FP4, `bf16` in bf16; the SFT start under both), averaged over k = "
        f"{e.eval.k} samples at temperature {e.eval.temperature}, {e.eval.problems_per_split} "
        f"problems per split; mean and sample std over seeds {list(table.seeds)}. Splits "
        f"(generated problems, named by task and level): {split_legend(e.eval.splits)}; "
        f"`average`: mean over {benchmark_splits(e.eval.splits)}"
        + (
            f"; `{agg.AVERAGE_BF16}`: the same average with each FP4 run's policy run in bf16"
            if any(agg.AVERAGE_BF16 in r for r in rows)
            else ""
        )
        + f".\n\n![curves]({table.name}.png)"
    )
    if adapt is not None:
        at, run, ref = adapt["matched_at"], adapt["run"], adapt["reference"]
        pts = ", ".join(
            f"step {p['step']}: {p[run]:.3f} vs {p[ref]:.3f} +- {p['ref_std']:.3f}"
            for p in adapt["points"]
        )
        when = f"first matches `{ref}` at step {at}" if at is not None else f"never matches `{ref}`"
        text += (
            f"\n\nAdaptation: on the hardest split (`{adapt['split']}`, lowest SFT score) `{run}` "
            f"{when} (mean over seeds at least {ref}'s mean minus its std; {pts})."
        )
    if shared := agg.shared_runs(table, workdir):
        text += (
            "\n\nRuns trained once for two tables (the same config and SFT start): "
            + "; ".join(f"`{label}` seed {seed} is `{src}`" for label, seed, src in shared)
            + "."
        )
    if from_logs:
        text = (
            f"Aggregated from the run logs in `{workdir}` (where and when the runs ran: the logs "
            "and that folder's README).\n\n" + text
        )
    if missing := agg.missing_seeds(table, rows):
        text = f"**Partial table**: seeds not yet run: {', '.join(missing)}.\n\n" + text
    return text


def write_table(
    table: Table, workdir: str, outdir: str, *, partial: bool = False, from_logs: bool = False
) -> list[dict]:
    """Aggregates the finished runs (`trace_jax.tables.aggregate`) and writes
    `<outdir>/<name>.{md,json,png}`; returns the rows. `partial`: over the finished seeds only
    (the table says which are missing); otherwise an unfinished run is an error."""
    rows = agg.aggregate(table, workdir, partial=partial)
    splits = table.experiment.eval.splits
    cols = ["run", "average", "average_std", *[c for s in splits for c in (s, f"{s}_std")]]
    if any(agg.AVERAGE_BF16 in r for r in rows):  # FP4 policies scored in bf16 as well
        cols[3:3] = [agg.AVERAGE_BF16, f"{agg.AVERAGE_BF16}_std"]
    md = harness.markdown_table(rows + agg.sft_rows(table, workdir), [*cols, "seeds"], fmt=".3f")
    md += (
        "\n\nTraining-log statistics (means over steps, then seeds; `code_mismatch` and "
        "`one_apart_fraction` over the mismatch-measuring steps, every "
        f"{table.experiment.rl.mismatch_every} steps; `train_rollout_kl_per_response`: each "
        "step's per-token KL times its mean response length, in nats; n/a: the trainer quantizes "
        "nothing):\n\n"
    )
    md += harness.markdown_table(rows, ["run", *agg.STAT_KEYS], fmt=".4g")
    if paired := agg.paired_differences(table, workdir):
        cols = list(dict.fromkeys(k for r in paired for k in r if k not in ("run", "seeds")))
        md += (
            "\n\nPaired by seed against `bf16` (each run's final benchmark average minus bf16's "
            "of the same seed, whose runs start from one SFT stage; mean and std over the seeds "
            "both finished; `average@bf16`: the FP4 run's policy scored in bf16):\n\n"
        )
        md += harness.markdown_table(paired, ["run", *cols, "seeds"], fmt=".3f")
    if gaps := agg.execution_gaps(table, workdir):
        md += (
            "\n\nFP4 execution gap (benchmark average of each FP4 run's policy run in bf16 minus "
            "run in its format, at the last evaluation and at the SFT start of the same seed; "
            "`widened`: end minus start; mean and std over seeds):\n\n"
        )
        cols = [c for k in agg.EXECUTION_GAP_KEYS for c in (k, f"{k}_std")]
        md += harness.markdown_table(gaps, ["run", *cols, "seeds"], fmt=".3f")
    adapt = agg.adaptation(table, workdir)
    harness.write_results(
        table.name,
        rows,
        title=table.title,
        table=md,
        notes=notes(table, workdir, rows, adapt, from_logs),
        outdir=outdir,
        extra={"paired_vs_bf16": agg.paired_differences(table, workdir), "fp4_execution_gap": gaps}
        | ({"adaptation": adapt} if adapt is not None else {}),
    )
    plot(table, workdir, os.path.join(outdir, f"{table.name}.png"), adapt)
    print(md)
    return rows


def run(
    table: Table,
    workdir: str,
    *,
    outdir: str,
    deadline_s: float | None = None,
    shard: tuple[int, int] = (0, 1),
    labels: Sequence[str] = (),
    sft_only: bool = False,
    aggregate_only: bool = False,
    partial: bool = False,
) -> list[dict] | None:
    """Trains what is missing; writes and returns the table once every run is finished.

    `shard = (i, n)` with n > 1: trains worker i's pairs only and writes no table (None);
    `labels`: trains only these runs (all seeds) and writes no table (None); `sft_only`: runs
    (or reuses) the SFT stage and stops (None); `aggregate_only`: trains nothing and writes the
    table from the runs' logs (e.g. brought back from a GPU machine without their checkpoints);
    an unfinished run is an error, unless `partial` (with `aggregate_only`): then the table is
    over the finished seeds and says so.
    """
    if partial and not aggregate_only:
        raise ValueError("--partial only aggregates (with --aggregate_only)")
    if sft_only:
        run_sft_stage(table, workdir)
        return None
    if not aggregate_only:
        done = train_runs(table, workdir, deadline_s=deadline_s, shard=shard, labels=labels)
        if not done or shard[1] > 1 or labels:
            return None
    return write_table(table, workdir, outdir, partial=partial, from_logs=aggregate_only)


def main(argv):
    del argv
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    rows = run(
        Table.from_config_dict(f.config),
        f.workdir,
        outdir=f.outdir,
        deadline_s=f.deadline_s if f.deadline_s > 0 else None,
        shard=parse_shard(f.shard),
        labels=tuple(f.runs),
        sft_only=f.sft_only,
        aggregate_only=f.aggregate_only,
        partial=f.partial,
    )
    if rows is None and not f.sft_only:
        print("table not written (incomplete, --shard or --runs): rerun without them")


if __name__ == "__main__":
    harness.define_config_flag(None)
    flags.DEFINE_string("workdir", "workdir/table", "runs, checkpoints, guidance stores")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where the table is written")
    flags.DEFINE_float("deadline_s", 0, "start no chunk after this many seconds (0: no deadline)")
    flags.DEFINE_string("shard", "", "i/n: train only the (run, seed) pairs i, i+n, ... (workers)")
    flags.DEFINE_list("runs", [], "train only these runs of the table (labels; default: all)")
    flags.DEFINE_bool("sft_only", False, "run (or reuse) the SFT stage and stop")
    flags.DEFINE_bool("aggregate_only", False, "train nothing; write the table from the run logs")
    flags.DEFINE_bool("partial", False, "with --aggregate_only: over the finished seeds only")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")
    app.run(main)
