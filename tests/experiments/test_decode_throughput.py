"""The decode-throughput benchmark: full-length rollouts per variant, tokens/s from their time."""

from __future__ import annotations

import json

import pytest

from experiments import decode_throughput


def test_quick_run_writes_rows(tmp_path):
    rows = decode_throughput.run(
        quick=True, lengths=[4], variants=["bf16", "fp4 xla"], outdir=str(tmp_path),
        name="dt", batch=2, repeats=1,
    )  # fmt: skip
    assert [(r["output_length"], r["variant"]) for r in rows] == [(4, "bf16"), (4, "fp4 xla")]
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(2 * r["output_length"] / r["seconds"])
        assert r["speedup_vs_bf16"] > 0
    assert [r["speedup_vs_bf16"] for r in rows if r["variant"] == "bf16"] == [1.0]
    saved = json.loads((tmp_path / "dt.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and "device" in saved["meta"]
    assert "QUICK MODE" in (tmp_path / "dt.md").read_text()


def test_unknown_variant():
    with pytest.raises(ValueError, match="unknown variants"):
        decode_throughput.run(quick=True, lengths=[4], variants=["fp8"], outdir="/tmp",
                              name="x", batch=2, repeats=1)  # fmt: skip
