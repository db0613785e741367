"""The quantize benchmark in its CPU smoke configuration: every launch checked and timed, the
fastest marked, bandwidth fractions from the bytes the op moves (timings are not checked)."""

from __future__ import annotations

import json

import pytest

from configs import bench_quantize as config_module
from experiments import bench_quantize as bench

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def test_smoke_run_times_every_launch_and_reports_the_fastest(tmp_path):
    config = config_module.get_config("smoke")
    # The last launch's column tile is a whole 256-wide row: skipped.
    config.launches = ((None, None, 4, None), (2, 64, 4, None), (2, None, 4, 64), (2, 256, 4, None))
    rows = bench.run(config, outdir=str(tmp_path), name="q")
    saved = json.loads((tmp_path / "q.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    summary = saved["summary"]
    copy_bw = summary["copy_bw_GBps"] * 1e9
    # Bytes moved at 256 x 256 bf16: the input, packed codes, compact bits, scale bytes and, for
    # NVFP4, one float32 global scale per row.
    moved = {"nvfp4": 131072 + 32768 + 8192 + 4096 + 1024, "mxfp4": 131072 + 32768 + 8192 + 2048}
    for fmt in ("nvfp4", "mxfp4"):
        pallas = [r for r in rows if r["format"] == fmt and r["implementation"] == "pallas"]
        assert [r["launch"] for r in pallas] == ["bdefault w4", "b2x64 w4", "b2 loop64 w4"]
        assert sum(r["fastest"] for r in pallas) == 1
        fastest = min(pallas, key=lambda r: r["ms"])
        assert fastest["fastest"]
        assert summary["bandwidth_fraction"][fmt] == fastest["bandwidth_fraction_of_copy"]
        for r in [
            *pallas,
            *(r for r in rows if r["format"] == fmt and r["implementation"] == "xla"),
        ]:
            want = moved[fmt] / (r["ms"] / 1e3) / copy_bw
            assert r["bandwidth_fraction_of_copy"] == pytest.approx(want, rel=1e-6)


def test_mark_fastest_marks_the_quickest_launch_only():
    rows = [{"launch": "a", "ms": 2.0}, {"launch": "b", "ms": 0.5}, {"launch": "c", "ms": 0.9}]
    marked = bench.mark_fastest(rows)
    assert [r["fastest"] for r in marked] == [False, True, False]
    assert [r["launch"] for r in marked] == ["a", "b", "c"]


def test_launch_labels():
    assert bench.launch_label(None, None, 4, None) == "bdefault w4"
    assert bench.launch_label(4, 1024, 4, None) == "b4x1024 w4"
    assert bench.launch_label(2, None, 8, 2048) == "b2 loop2048 w8"
