r"""Code mismatch per layer and quantization site over whole RL runs, with and without guidance.

  python -m experiments.site_mismatch --config=configs/table1_nvfp4.py \
      --workdir=experiments/results/runs/table1_nvfp4

Reads the `mismatch/<layer>/<site>` entries a table's runs logged (`rl_metrics.jsonl`, every
`rl.mismatch_every` steps: the fraction of the trainer's FP4 codes that differ from the rollout's
on the first mini-batch, before any update) and averages them over those steps, then over seeds
(std over seeds). Each run's guided sites come from its method's recipe, so the table shows the
same site with guidance (e.g. `trace`'s deeper layers) and without (`fp4_qat`, and `trace`'s
shallow layers). Writes `<table>_site_mismatch.md / .json / .png`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import harness, paper_table, sft
from trace_jax.rl.methods import get_method, layers_from_spec
from trace_jax.rl.metrics_log import read_rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PREFIX = "mismatch/"


def guided_keys(cfg, overrides: dict) -> frozenset[str]:
    """The "layer/site" keys a table run's rollout captures guidance for (empty: no guidance)."""
    rl = cfg.rl.copy_and_resolve_references()
    for key, value in overrides.items():
        rl[key.partition(".")[2]] = value
    n_layers = sft.model_config(cfg).n_layers
    layers = layers_from_spec(rl.guided_layers, n_layers) if rl.guided_layers else None
    return frozenset(get_method(rl.method).setup(rl.format, n_layers, guided_layers=layers).capture)


def per_site(seed_rows: Sequence[Sequence[dict]]) -> dict[str, tuple[float, float, int]]:
    """site key -> (mean over seeds of each seed's mean over its mismatch steps, std over seeds
    (ddof 1; nan for one seed), number of seeds), from each seed's `rl_metrics` rows."""
    per_seed: dict[str, list[float]] = {}
    for rows in seed_rows:
        keys = sorted({k for r in rows for k in r if k.startswith(PREFIX)})
        for k in keys:
            vals = [r[k] for r in rows if k in r]
            per_seed.setdefault(k[len(PREFIX) :], []).append(float(np.mean(vals)))
    return {
        k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"), len(v))
        for k, v in per_seed.items()
    }


def _key_order(key: str) -> tuple[int, str]:
    layer, _, site = key.partition("/")
    return int(layer), site


def collect(cfg, workdir: str) -> list[dict]:
    """One row per (run, layer, site) with measured mismatch: mean, std over seeds, guided."""
    rows = []
    for label, overrides in cfg.table.runs:
        dirs = [paper_table.run_dir(workdir, label, s) for s in cfg.table.seeds]
        logs = [read_rows(os.path.join(d, "rl_metrics.jsonl"), missing_ok=True) for d in dirs]
        stats = per_site([r for r in logs if r])
        guided = guided_keys(cfg, dict(overrides))
        for key in sorted(stats, key=_key_order):
            mean, std, n = stats[key]
            layer, site = _key_order(key)
            rows.append(
                {
                    "run": label,
                    "layer": layer,
                    "site": site,
                    "guided": key in guided,
                    "mismatch": mean,
                    "mismatch_std": std,
                    "seeds": n,
                }
            )
    return rows


def summary(rows: Sequence[dict]) -> list[dict]:
    """Per run: mean mismatch over its guided sites and over its unguided sites."""
    out = []
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == run]
        row = {"run": run}
        for name, flag in (("guided_sites", True), ("unguided_sites", False)):
            vals = [r["mismatch"] for r in mine if r["guided"] is flag]
            row[name] = float(np.mean(vals)) if vals else float("nan")
            row[f"n_{name}"] = len(vals)
        out.append(row)
    return out


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """Mismatch against layer, one panel per site, one line per run (guided points filled)."""
    sites = sorted({r["site"] for r in rows})
    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, axes = plt.subplots(1, len(sites), figsize=(4 * len(sites), 3.4), sharey=True)
    for ax, site in zip(np.atleast_1d(axes), sites, strict=True):
        for i, run in enumerate(runs):
            mine = sorted(
                (r for r in rows if r["run"] == run and r["site"] == site), key=lambda r: r["layer"]
            )
            if not mine:
                continue
            x = [r["layer"] for r in mine]
            y = [100 * max(r["mismatch"], 1e-5) for r in mine]
            (line,) = ax.plot(x, y, marker="o", mfc="none", label=run, color=f"C{i}")
            gx = [a for a, r in zip(x, mine, strict=True) if r["guided"]]
            gy = [b for b, r in zip(y, mine, strict=True) if r["guided"]]
            ax.plot(gx, gy, "o", color=line.get_color())
        ax.set(title=site, xlabel="layer", yscale="log")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("code mismatch % (filled: guided)")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg, workdir: str, outdir: str = harness.RESULTS_DIR) -> list[dict]:
    rows = collect(cfg, workdir)
    if not rows:
        raise ValueError(f"no mismatch/<layer>/<site> entries in the run logs under {workdir}")
    name = f"{cfg.table.name}_site_mismatch"
    sums = summary(rows)
    runs = list(dict.fromkeys(r["run"] for r in rows))
    keys = sorted({f"{r['layer']}/{r['site']}" for r in rows}, key=_key_order)
    by = {(r["run"], f"{r['layer']}/{r['site']}"): r for r in rows}
    wide = []
    for key in keys:
        row = {"layer/site": key}
        for run_label in runs:
            r = by.get((run_label, key))
            if r is not None:
                mark = "*" if r["guided"] else ""
                row[run_label] = f"{100 * r['mismatch']:.3f} +- {100 * r['mismatch_std']:.3f}{mark}"
        wide.append(row)
    table = harness.markdown_table(sums, list(sums[0]))
    table += "\n\nPer layer and site (code mismatch %, mean +- std over seeds; `*`: guided):\n\n"
    table += harness.markdown_table(wide, ["layer/site", *runs])
    every = cfg.rl.get("mismatch_every", 0)
    notes = (
        f"{cfg.table.title}: code mismatch between the trainer's FP4 codes and the rollout's, per "
        f"layer and quantization site, measured every {every} steps on the first mini-batch "
        "before the update; mean over those steps, then over seeds. `guided_sites` / "
        "`unguided_sites`: the mean over the run's sites with / without rollout guidance. "
        f"Run logs: `{workdir}`. In the plot (log scale) zeros are drawn at 0.001%."
        f"\n\n![per site]({name}.png)"
    )
    harness.write_results(
        name, rows, title=f"Code mismatch per layer and site: {cfg.table.title}", table=table,
        notes=notes, outdir=outdir, extra={"summary": sums},
    )  # fmt: skip
    plot(rows, os.path.join(outdir, f"{name}.png"), cfg.table.title)
    print(table)
    return rows


def main(argv):
    del argv
    run(flags.FLAGS.config, flags.FLAGS.workdir, flags.FLAGS.outdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "a table config (configs/table*.py)")
    flags.DEFINE_string("workdir", None, "the table's run directories (<label>/seed<k>/)")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where results are written")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
