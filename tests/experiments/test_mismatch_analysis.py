"""The mismatch-analysis entry point runs end to end and its numbers behave as the spec says."""

from __future__ import annotations

import json
import os

import pytest

from configs import mismatch_analysis as config_module
from experiments import mismatch_analysis


def test_mismatch_analysis_writes_results(tmp_path):
    config = config_module.get_config()
    config.eps, config.formats, config.rows, config.cols = (
        (1e-3, 1e-1),
        ("nvfp4", "mxfp4"),
        256,
        128,
    )
    mismatch_analysis.run(config, outdir=str(tmp_path))
    for ext in ("md", "json", "png"):
        assert os.path.getsize(tmp_path / f"mismatch_analysis.{ext}") > 0
    rows = json.loads((tmp_path / "mismatch_analysis.json").read_text())["rows"]
    assert {(r["format"], r["eps"]) for r in rows} == {
        ("nvfp4", 1e-3),
        ("nvfp4", 0.1),
        ("mxfp4", 1e-3),
        ("mxfp4", 0.1),
    }
    for r in rows:
        for key in (
            "rtn_mismatch",
            "guided_full_mismatch",
            "guided_compact_mismatch",
            "one_apart_fraction",
        ):
            assert key in r
        # Guidance never increases the mismatch, and removes it entirely at small eps.
        assert r["guided_full_mismatch"] <= r["rtn_mismatch"]
        assert r["guided_compact_mismatch"] == r["guided_full_mismatch"] or r["eps"] > 0.01
        if r["eps"] == 1e-3:
            assert r["rtn_mismatch"] > 0 and r["guided_compact_mismatch"] == 0


def test_columns_must_fill_whole_blocks(tmp_path):
    config = config_module.get_config()
    config.cols = 100
    with pytest.raises(ValueError, match="multiple of 32, got 100"):
        mismatch_analysis.run(config, outdir=str(tmp_path))
