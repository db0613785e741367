"""The MoE matmul benchmark in its CPU smoke configuration: both Pallas program orders checked
against the XLA reference, the faster one reported against `ragged_dot` (timings not checked)."""

from __future__ import annotations

import json

import pytest

from configs import bench_moe_matmul as config_module
from experiments import bench_moe_matmul as bench


def test_smoke_run_writes_one_row_per_phase(tmp_path):
    config = config_module.get_config("smoke")
    rows = bench.run(config, outdir=str(tmp_path), name="moe")
    assert [(r["phase"], r["M"]) for r in rows] == [("decode", 32), ("prefill", 128)]
    for r in rows:
        assert (r["G"], r["K"], r["N"]) == (4, 64, 64)
        assert set(r["fp4_ms_by_grid"]) == {"row_tiles", "groups"}
        assert (
            r["fp4_ms"] == min(r["fp4_ms_by_grid"].values()) == r["fp4_ms_by_grid"][r["fp4_grid"]]
        )
        assert r["speedup"] == pytest.approx(r["bf16_ragged_dot_ms"] / r["fp4_ms"])
        # The same FP4 operands, float32 accumulation: only summation order differs.
        assert 0 <= r["fp4_rel_err_vs_reference"] < 1e-5
    saved = json.loads((tmp_path / "moe.json").read_text())
    assert saved["summary"]["speedup"] == {r["phase"]: r["speedup"] for r in rows}
