r"""Code mismatch per layer and quantization site over whole RL runs, with and without guidance.

  python -m experiments.site_mismatch --config=configs/table1_nvfp4.py \
      --workdir=experiments/results/runs/table1_nvfp4

Reads the `mismatch/<layer>/<site>` entries a table's runs logged (every `rl.mismatch_every`
steps: the fraction of the trainer's FP4 codes that differ from the rollout's on the first
mini-batch, before any update), averages them over those steps, then over seeds (std over
seeds), and marks each site guided or not from its run's method and guided layers
(`trace_jax.tables.site_mismatch`). Writes `<outdir>/<table>_site_mismatch.{md,json,png}`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib
import numpy as np
from absl import app, flags

from experiments import harness
from trace_jax.tables.grid import Table
from trace_jax.tables.site_mismatch import collect, key_order, summary

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """Mismatch against layer, one panel per site, one line per run (guided points filled)."""
    sites = sorted({r["site"] for r in rows})
    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, axes = plt.subplots(1, len(sites), figsize=(4 * len(sites), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, site in zip(axes, sites, strict=True):
        for i, run in enumerate(runs):
            mine = sorted(
                (r for r in rows if r["run"] == run and r["site"] == site), key=lambda r: r["layer"]
            )
            if not mine:
                continue
            x = [r["layer"] for r in mine]
            y = [100 * max(r["mismatch"], 1e-5) for r in mine]
            (line,) = ax.plot(x, y, marker="o", mfc="none", label=run, color=f"C{i}")
            guided = [(a, b) for a, b, r in zip(x, y, mine, strict=True) if r["guided"]]
            if guided:
                ax.plot(*zip(*guided, strict=True), "o", color=line.get_color())
        ax.set(title=site, xlabel="layer", yscale="log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("code mismatch % (filled: guided)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(table: Table, workdir: str, outdir: str = harness.RESULTS_DIR) -> list[dict]:
    """Collects the table's per-site mismatch from the run logs in `workdir` and writes it;
    returns the rows (one per run, layer and site)."""
    rows = collect(table, workdir)
    if not rows:
        raise ValueError(f"no mismatch/<layer>/<site> entries in the run logs under {workdir}")
    name = f"{table.name}_site_mismatch"
    sums = summary(rows)
    runs = list(dict.fromkeys(r["run"] for r in rows))
    keys = sorted({f"{r['layer']}/{r['site']}" for r in rows}, key=key_order)
    by = {(r["run"], f"{r['layer']}/{r['site']}"): r for r in rows}
    wide = []
    for key in keys:
        row = {"layer/site": key}
        for label in runs:
            if (r := by.get((label, key))) is not None:
                mark = "*" if r["guided"] else ""
                row[label] = f"{100 * r['mismatch']:.3f} +- {100 * r['mismatch_std']:.3f}{mark}"
        wide.append(row)
    md = harness.markdown_table(sums, list(sums[0]))
    md += "\n\nPer layer and site (code mismatch %, mean +- std over seeds; `*`: guided):\n\n"
    md += harness.markdown_table(wide, ["layer/site", *runs])
    notes = (
        f"{table.title}: code mismatch between the trainer's FP4 codes and the rollout's, per "
        f"layer and quantization site, measured every {table.experiment.rl.mismatch_every} "
        "steps on the first mini-batch before the update; mean over those steps, then over "
        "seeds. `guided_sites` / `unguided_sites`: the mean over the run's sites with / without "
        f"rollout guidance. Run logs: `{workdir}`. In the plot (log scale) zeros are drawn at "
        f"0.001%.\n\n![per site]({name}.png)"
    )
    harness.write_results(
        name, rows, title=f"Code mismatch per layer and site: {table.title}", table=md,
        notes=notes, outdir=outdir, extra={"summary": sums},
    )  # fmt: skip
    plot(rows, os.path.join(outdir, f"{name}.png"), table.title)
    print(md)
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    run(Table.from_config_dict(f.config), f.workdir, f.outdir)


if __name__ == "__main__":
    harness.define_config_flag(None)
    flags.DEFINE_string("workdir", None, "the table's run directories (<label>/seed<k>/)")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where results are written")
    flags.mark_flags_as_required(["workdir"])
    app.run(main)
