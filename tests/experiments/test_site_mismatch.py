"""Per-site code mismatch over a table's run logs: means over steps then seeds, guided flags
from each method's recipe."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import site_mismatch
from experiments.table_session import load_table


def _table_cfg():
    return load_table("configs/table1_nvfp4.py", [])


def test_site_mismatch_means_and_guided_sites(tmp_path):
    cfg = _table_cfg()
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
            d = tmp_path / run / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "rl_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = site_mismatch.run(cfg, str(tmp_path), outdir=str(tmp_path / "out"))
    assert {r["run"] for r in rows} == {"fp4_qat", "trace"}  # runs without logs are left out
    for r in rows:
        key = f"{r['layer']}/{r['site']}"
        seed_means = [np.mean(logged[r["run"], s][key]) for s in (0, 1)]
        assert r["mismatch"] == pytest.approx(np.mean(seed_means))
        assert r["mismatch_std"] == pytest.approx(np.std(seed_means, ddof=1))
        # trace guides the deeper half (layers 4-7 of 8); fp4_qat guides nothing.
        assert r["guided"] == (r["run"] == "trace" and r["layer"] >= 4)
    assert [(r["layer"], r["site"]) for r in rows if r["run"] == "trace"] == [
        (0, "k"), (4, "k"), (7, "expert_mid")
    ]  # fmt: skip
    summary = {s["run"]: s for s in site_mismatch.summary(rows)}
    assert summary["trace"]["n_guided_sites"] == 2 and summary["trace"]["n_unguided_sites"] == 1
    assert np.isnan(summary["fp4_qat"]["guided_sites"])
    md = (tmp_path / "out" / "table1_nvfp4_site_mismatch.md").read_text()
    assert "4/k" in md and "*" in md
    assert (tmp_path / "out" / "table1_nvfp4_site_mismatch.png").exists()


def test_no_mismatch_entries_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no mismatch"):
        site_mismatch.run(_table_cfg(), str(tmp_path), outdir=str(tmp_path))


def test_guided_keys_follow_the_runs_guided_layers():
    cfg = load_table("configs/table5_layers.py", [])
    layers = {
        label: sorted({int(k.split("/")[0]) for k in site_mismatch.guided_keys(cfg, dict(ov))})
        for label, ov in cfg.table.runs
    }
    assert layers == {
        "trace all": list(range(8)),
        "trace half": [4, 5, 6, 7],
        "trace quarter": [6, 7],
        "trace eighth": [7],
    }
