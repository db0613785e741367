r"""Table 7 analog: a BF16-trained policy quantized after training vs TRACE's final FP4 policy.

  python -m experiments.ptq_table --config=configs/table7_ptq.py \
      --bf16_policy=<bf16 run seed 0>,<seed 1>,... --trace_policy=<trace run seed 0>,...

(a policy is an RL workdir, whose final checkpoint is used, or parameters saved by
`trace_jax.rl.checkpoint.save_params`). The BF16-trained policy of each training seed is
evaluated in bf16 and, quantized with each post-training recipe (vanilla NVFP4, 4over6, H-Scale
calibrated on `ptq.calibration_prompts` training prompts), with FP4 execution; beside them, if
given, TRACE's final policy with its own FP4 execution (`trace_jax.tables.ptq_table`). pass@1
per held-out split and their benchmark average, mean +- std over seeds; the summed squared
weight error of each recipe. Writes `<outdir>/<name>.{md,json,png}`.

Each seed's rows are kept in `<outdir>/<name>_seeds/seed<k>.json` as soon as they are computed:
a rerun reuses every part computed from the same policy (an interrupted table resumes; a first
run with the BF16 policies only can start while the TRACE policies still train). `--gpus=0,1`
evaluates the seeds in parallel subprocesses, seed k on GPU `gpus[k % len(gpus)]`, then merges
their files; `--plot_from=<name>.json` only redraws the PNG.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib
import numpy as np
from absl import app, flags

from experiments import harness
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.logs import quiet_third_party
from trace_jax.tables import ptq_table
from trace_jax.tables.grid import BENCHMARK_SPLITS, benchmark_splits
from trace_jax.tasks.splits import split_legend, with_current_split_names

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TITLE = "Table 7 analog: post-training FP4 quantization vs TRACE"


def plot(rows: Sequence[dict], path: str) -> None:
    """pass@1 x100 per benchmark split and their average: one group of bars per split, one bar
    per policy (mean over seeds, sample std as error bar, each seed a dot). `rows` as written by
    `run` (with `<key>_seeds`)."""
    keys = [k for k in (*BENCHMARK_SPLITS, "average") if f"{k}_seeds" in rows[0]]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(keys), 3.8))
    for i, row in enumerate(rows):
        x = np.arange(len(keys)) + (i - (len(rows) - 1) / 2) * width
        mean = [100 * row[k] for k in keys]
        std = [100 * np.nan_to_num(row[f"{k}_std"]) for k in keys]
        ax.bar(x, mean, width, yerr=std, capsize=2, color=f"C{i}", label=row["policy"])
        for xi, k in zip(x, keys, strict=True):
            seeds = [100 * v for v in row[f"{k}_seeds"]]
            ax.plot([xi] * len(seeds), seeds, ".", color="k", ms=3)
    lo = min(100 * v for r in rows for k in keys for v in r[f"{k}_seeds"])
    ax.set(xticks=np.arange(len(keys)), xticklabels=keys, ylabel="pass@1 x100", ylim=(lo - 8, None))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(TITLE, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_from(path: str) -> str:
    """Redraws `<table>.png` beside a written `<table>.json` (its policies may be gone); returns
    the PNG's path."""
    rows = harness.rows_written_by(path, "experiments.ptq_table", ("policy", "average_seeds"))
    rows = [with_current_split_names(r) for r in rows]  # also a JSON written under older names
    out = os.path.splitext(path)[0] + ".png"
    plot(rows, out)
    return out


def run(
    config: ExperimentConfig,
    *,
    bf16_policies: Sequence[str],
    trace_policies: Sequence[str] = (),
    calibration_prompts: int,
    outdir: str = harness.RESULTS_DIR,
    name: str = "table7_ptq",
    gpus: Sequence[str] = (),
    worker_seed: int | None = None,
) -> list[dict]:
    """The table over seeds: `bf16_policies[k]` and `trace_policies[k]` (if given) are the final
    policies of training seed k. `gpus`: evaluate the seeds in parallel subprocesses;
    `worker_seed`: (such a subprocess) evaluate that seed only, write its file, no table."""
    pairs = ptq_table.policy_pairs(bf16_policies, trace_policies)

    def seed_rows(k: int) -> list[dict]:
        return ptq_table.seed_rows(config, outdir, name, k, *pairs[k], calibration_prompts)

    if worker_seed is not None:
        return seed_rows(worker_seed)
    if gpus:
        if failed := harness.run_workers(
            "experiments.ptq_table", "worker_seed", range(len(pairs)), gpus
        ):
            raise RuntimeError(f"PTQ evaluation of seeds {failed} failed")
    per_seed = [seed_rows(k) for k in range(len(pairs))]
    rows = ptq_table.over_seeds(per_seed)
    columns = ["policy", "average", "average_std", *config.eval.splits, "weight_sq_error", "seeds"]
    ev = config.eval
    notes = (
        f"pass@1 (k={ev.k}, {ev.problems_per_split} problems per split, temperature "
        f"{ev.temperature}), mean over {len(per_seed)} training seeds (`average_std`: sample std "
        "over seeds; every split's std and per-seed values are in the JSON). Splits (generated "
        f"problems, named by task and level): {split_legend(ev.splits)}; `average`: mean over "
        f"{benchmark_splits(ev.splits)}. H-Scale calibrated "
        f"on {calibration_prompts} training prompts; weight_sq_error: summed squared error of the "
        f"routed-expert weights.\n\n![pass@1 by policy]({name}.png)"
    )
    harness.write_table(name, rows, columns, title=TITLE, notes=notes, outdir=outdir)
    plot(rows, os.path.join(outdir, f"{name}.png"))
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    if f.plot_from:
        print(f"wrote {plot_from(f.plot_from)}")
        return
    if not f.bf16_policy:
        raise app.UsageError("--bf16_policy is required (or --plot_from)")
    ptq = from_section(ptq_table.PTQTableConfig, f.config.ptq)
    run(
        ExperimentConfig.from_config_dict(f.config),
        bf16_policies=f.bf16_policy,
        trace_policies=f.trace_policy,
        calibration_prompts=ptq.calibration_prompts,
        outdir=f.outdir,
        name=f.name,
        gpus=f.gpus,
        worker_seed=None if f.worker_seed < 0 else f.worker_seed,
    )


if __name__ == "__main__":
    harness.define_config_flag("table7_ptq")
    flags.DEFINE_list("bf16_policy", [], "BF16-trained policies, one per seed (RL workdirs)")
    flags.DEFINE_list("trace_policy", [], "TRACE's final policies, one per seed (optional)")
    harness.define_result_flags("table7_ptq")
    flags.DEFINE_list("gpus", [], "evaluate the seeds in parallel, seed k on gpus[k % len(gpus)]")
    flags.DEFINE_integer("worker_seed", -1, "internal: evaluate this seed only (a --gpus worker)")
    flags.DEFINE_string("plot_from", "", "only redraw <table>.png from this written <table>.json")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")
    app.run(main)
