"""The train-rollout gap entry point writes its table, per-site rows and plot."""

from __future__ import annotations

import json

from configs import train_rollout_gap
from experiments.train_rollout_gap import write
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables.gap import GapConfig, GapResult


def test_written_results(tmp_path):
    config = ExperimentConfig.from_config_dict(train_rollout_gap.get_config())
    rows = [
        {"mode": m, "replay": r, "logp_gap_mean": 0.1, "code_mismatch": 0.01}
        for m in ("rtn", "guided full") for r in (False, True)
    ]  # fmt: skip
    per_site = [
        {"mode": m, "replay": True, "layer": i, "site": "expert_in", "code_mismatch": 0.01 * i}
        for m in ("rtn", "guided full") for i in range(4)
    ]  # fmt: skip
    result = GapResult(rows=rows, per_site=per_site, guided_layers=(2, 3), policy="random init")
    paths = write(config, GapConfig(), result, outdir=str(tmp_path), name="gap")
    saved = json.loads((tmp_path / "gap.json").read_text())
    assert saved["rows"] == rows and saved["per_site"] == per_site
    md = (tmp_path / "gap.md").read_text()
    assert paths["md"] == str(tmp_path / "gap.md") and "guided layers [2, 3] of 4" in md
    assert "| guided full | True | 0.1 |" in md and "random init, recipe `nvfp4`" in md
    assert (tmp_path / "gap.png").read_bytes()[:4] == b"\x89PNG"
