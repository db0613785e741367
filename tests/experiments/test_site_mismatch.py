"""The per-site mismatch entry point: its table and plot from a table's run logs."""

from __future__ import annotations

import json

import pytest

from configs import table1_nvfp4
from experiments import site_mismatch
from tests.tables import support
from trace_jax.tables.grid import Table


def test_written_from_run_logs(tmp_path):
    table = Table.from_config_dict(table1_nvfp4.get_config())
    for run, value in (("fp4_qat", 0.02), ("trace", 0.001)):
        metrics = [{"step": 0, "mismatch/0/k": 0.03, "mismatch/4/k": value}, {"step": 1}]
        support.write_run_logs(tmp_path / "w", run, 0, [], metrics)
    rows = site_mismatch.run(table, str(tmp_path / "w"), outdir=str(tmp_path))
    assert [(r["run"], r["layer"], r["guided"]) for r in rows] == [
        ("fp4_qat", 0, False), ("fp4_qat", 4, False), ("trace", 0, False), ("trace", 4, True),
    ]  # fmt: skip
    md = (tmp_path / "table1_nvfp4_site_mismatch.md").read_text()
    assert "| 4/k | 2.000 +- nan | 0.100 +- nan* |" in md
    saved = json.loads((tmp_path / "table1_nvfp4_site_mismatch.json").read_text())
    assert saved["summary"][1] == {
        "run": "trace", "guided_sites": 0.001, "n_guided_sites": 1, "unguided_sites": 0.03,
        "n_unguided_sites": 1,
    }  # fmt: skip
    assert (tmp_path / "table1_nvfp4_site_mismatch.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no mismatch"):
        site_mismatch.run(table, str(tmp_path / "empty"), outdir=str(tmp_path))
