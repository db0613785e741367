"""The kernel benchmark runs end to end in its CPU smoke mode (numbers are not checked)."""

from __future__ import annotations

import json

from experiments import bench_kernels


def test_bench_kernels_quick(tmp_path):
    summary = bench_kernels.run(quick=True, outdir=str(tmp_path), name="k")
    data = json.loads((tmp_path / "k.json").read_text())
    for key in (
        "quantize_bandwidth_fraction",
        "decode_attention_bandwidth_fraction",
        "speedup_vs_best_bf16_at_32k_plus",
        "decode_step_speedup",
        "guidance_capture_overhead",
        "device",
    ):
        assert key in data["summary"] and key in summary
    assert set(summary["quantize_bandwidth_fraction"]) == {"nvfp4", "mxfp4"}
    # Each launch is its own row; the summary reports the fastest Pallas launch per format.
    for fmt, frac in summary["quantize_bandwidth_fraction"].items():
        quantize = [r for r in data["rows"] if r["section"] == "quantize"]
        pallas = [r for r in quantize if r["format"] == fmt and r["backend"] == "pallas"]
        assert len(pallas) >= 2 and sum(r["fastest"] for r in pallas) == 1
        assert frac == max(r["bandwidth_fraction_of_copy"] for r in pallas)


def test_mark_fastest_marks_the_quickest_launch_only():
    rows = [{"launch": "a", "ms": 2.0}, {"launch": "b", "ms": 0.5}, {"launch": "c", "ms": 0.9}]
    marked = bench_kernels.mark_fastest(rows)
    assert [r["fastest"] for r in marked] == [False, True, False]
    assert [r["launch"] for r in marked] == ["a", "b", "c"]
