"""The train-rollout gap entry point runs end to end on a minimal problem."""

from __future__ import annotations

import json

from experiments import train_rollout_gap
from tests import tiny


def test_train_rollout_gap_smoke(tmp_path):
    train_rollout_gap.run(
        n_layers=tiny.N_LAYERS, batch=2, prompt_len=4, max_new=4, outdir=str(tmp_path), name="gap"
    )
    data = json.loads((tmp_path / "gap.json").read_text())
    rows = data["rows"]
    assert [r["mode"] for r in rows] == ["off (bf16 pair)"] + [
        m for m in ("rtn", "guided full", "guided compact") for _ in (0, 1)
    ]
    keys = (
        "mode",
        "replay",
        "logp_gap_mean",
        "logp_gap_max",
        "kl",
        "code_mismatch",
        "one_apart_fraction",
        "router_agreement",
        "guidance_bytes_per_token",
    )
    for r in rows:
        assert all(k in r for k in keys)
    by = {(r["mode"], r["replay"]): r for r in rows}
    assert by[("guided full", True)]["code_mismatch"] <= by[("rtn", True)]["code_mismatch"]
    assert (
        0
        < by[("guided compact", True)]["guidance_bytes_per_token"]
        < by[("guided full", True)]["guidance_bytes_per_token"]
    )
    assert data["per_site"] and (tmp_path / "gap.png").stat().st_size > 0
