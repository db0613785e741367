"""Per-site code mismatch over a table's run logs: means over steps then seeds, guided flags
from each run's method and guided layers."""

from __future__ import annotations

import numpy as np
import pytest

from configs import table1_nvfp4, table5_layers
from tests.tables import support
from trace_jax.tables import site_mismatch
from trace_jax.tables.grid import Table


def test_site_means_and_guided_sites(tmp_path):
    table = Table.from_config_dict(table1_nvfp4.get_config())  # `small`: 8 layers
    rng = np.random.default_rng(0)
    logged = {}  # (run, seed) -> {key: values over steps}
    for run in ("fp4_qat", "trace"):
        for seed in (0, 1):
            steps = (0, 2, 4) if seed == 0 else (1, 5)  # unequal counts: a mean per seed first
            vals = {k: rng.uniform(0, 0.1, len(steps)) for k in ("0/k", "4/k", "7/expert_mid")}
            logged[run, seed] = vals
            rows = [{"step": s, "reward": 0.5} for s in range(6)]
            for i, s in enumerate(steps):  # mismatch steps only carry the keys
                rows[s].update({f"mismatch/{k}": float(v[i]) for k, v in vals.items()})
            support.write_run_logs(tmp_path, run, seed, [], rows)
    rows = site_mismatch.collect(table, str(tmp_path))
    assert {r["run"] for r in rows} == {"fp4_qat", "trace"}  # runs without logs are left out
    for r in rows:
        key = f"{r['layer']}/{r['site']}"
        seed_means = [np.mean(logged[r["run"], s][key]) for s in (0, 1)]
        assert r["mismatch"] == pytest.approx(np.mean(seed_means))
        assert r["mismatch_std"] == pytest.approx(np.std(seed_means, ddof=1))
        assert r["seeds"] == 2
        # trace guides the deeper half (layers 4-7 of 8); fp4_qat guides nothing.
        assert r["guided"] == (r["run"] == "trace" and r["layer"] >= 4)
    assert [(r["layer"], r["site"]) for r in rows if r["run"] == "trace"] == [
        (0, "k"), (4, "k"), (7, "expert_mid")
    ]  # fmt: skip
    summary = {s["run"]: s for s in site_mismatch.summary(rows)}
    assert summary["trace"]["n_guided_sites"] == 2 and summary["trace"]["n_unguided_sites"] == 1
    guided = [r["mismatch"] for r in rows if r["run"] == "trace" and r["guided"]]
    assert summary["trace"]["guided_sites"] == pytest.approx(np.mean(guided))
    assert np.isnan(summary["fp4_qat"]["guided_sites"])


def test_guided_keys_follow_the_runs_guided_layers():
    table = Table.from_config_dict(table5_layers.get_config())
    layers = {
        label: sorted({int(k.split("/")[0]) for k in site_mismatch.guided_keys(table, label)})
        for label in table.labels
    }
    assert layers == {
        "trace all": list(range(8)),
        "trace half": [4, 5, 6, 7],
        "trace quarter": [6, 7],
        "trace eighth": [7],
    }
