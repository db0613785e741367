"""Code mismatch per layer and quantization site over a table's runs, with and without guidance.

Each run logs `mismatch/<layer>/<site>` every `rl.mismatch_every` steps (`rl_metrics.jsonl`:
the fraction of the trainer's FP4 codes that differ from the rollout's on the first mini-batch,
before any update). `collect` averages them over those steps, then over seeds (std over seeds),
and flags each site guided or not from the run's method and guided layers, so the same site
shows up with guidance (e.g. `trace`'s deeper layers) and without (`fp4_qat`, and `trace`'s
shallow layers).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from trace_jax.rl.methods import get_method
from trace_jax.rl.metrics_log import read_rows
from trace_jax.tables.grid import Table, run_dir

PREFIX = "mismatch/"


def guided_keys(table: Table, label: str) -> frozenset[str]:
    """The "layer/site" keys run `label`'s rollout captures guidance for (empty: none)."""
    config = table.run_config(label, table.seeds[0])
    rl = config.rl
    setup = get_method(rl.method).setup(
        rl.format, config.model.n_layers, guided_layers=rl.guided_layers or None
    )
    return frozenset(setup.capture)


def per_site(seed_rows: Sequence[Sequence[dict]]) -> dict[str, tuple[float, float, int]]:
    """site key -> (mean over seeds of each seed's mean over its mismatch steps, std over seeds
    (ddof 1; nan for one seed), number of seeds), from each seed's `rl_metrics` rows."""
    per_seed: dict[str, list[float]] = {}
    for rows in seed_rows:
        for k in sorted({k for r in rows for k in r if k.startswith(PREFIX)}):
            vals = [r[k] for r in rows if k in r]
            per_seed.setdefault(k.removeprefix(PREFIX), []).append(float(np.mean(vals)))
    return {
        k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"), len(v))
        for k, v in per_seed.items()
    }


def key_order(key: str) -> tuple[int, str]:
    """ "<layer>/<site>" -> (layer, site): sorts keys by layer number, then site."""
    layer, _, site = key.partition("/")
    return int(layer), site


def collect(table: Table, workdir: str) -> list[dict]:
    """One row per (run, layer, site) with measured mismatch: {"run", "layer", "site",
    "guided", "mismatch" (mean), "mismatch_std" (over seeds), "seeds"}; runs without logs are
    left out."""
    rows = []
    for label in table.labels:
        logs = [
            read_rows(os.path.join(run_dir(workdir, label, s), "rl_metrics.jsonl"), missing_ok=True)
            for s in table.seeds
        ]
        stats = per_site([r for r in logs if r])
        guided = guided_keys(table, label)
        for key in sorted(stats, key=key_order):
            mean, std, n = stats[key]
            layer, site = key_order(key)
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
    """Per run: the mean mismatch over its guided sites and over its unguided sites (nan for
    none), and how many of each (`n_guided_sites`, `n_unguided_sites`)."""
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
