"""The decode-throughput benchmark: full-length rollouts per variant, tokens/s from their time."""

from __future__ import annotations

import json

import matplotlib.axes
import pytest

from configs import decode_throughput as config_module
from experiments import decode_throughput


def smoke_config(**overrides):
    config = config_module.get_config("smoke")
    config.lengths, config.variants = (4,), ("bf16", "fp4 xla")
    config.update(overrides)
    return config


def test_quick_run_writes_rows(tmp_path):
    rows = decode_throughput.run(smoke_config(), outdir=str(tmp_path), name="dt")
    assert [(r["output_length"], r["variant"]) for r in rows] == [(4, "bf16"), (4, "fp4 xla")]
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(2 * r["output_length"] / r["seconds"])
        assert r["speedup_vs_bf16"] > 0
    assert [r["speedup_vs_bf16"] for r in rows if r["variant"] == "bf16"] == [1.0]
    saved = json.loads((tmp_path / "dt.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and "device" in saved["meta"]
    assert "SMOKE RUN" in (tmp_path / "dt.md").read_text()
    assert (tmp_path / "dt.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_draws_the_latest_run_of_each_point(tmp_path, monkeypatch):
    def row(length, variant, tps, ratio, run):
        return {"output_length": length, "variant": variant, "tokens_per_s": tps,
                "speedup_vs_bf16": ratio, "measured_by": run}  # fmt: skip

    rows = [
        row(1024, "bf16", 100.0, 1.0, "A"),
        row(1024, "fp4", 70.0, 0.7, "A"),
        row(8192, "bf16", 90.0, 1.0, "A"),
        row(8192, "fp4", 60.0, 0.66, "A"),
        row(8192, "bf16", 80.0, 1.0, "B"),  # a later run of the same points wins
        row(8192, "fp4", 72.0, 0.9, "B"),
    ]
    (tmp_path / "dt.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    lines = []
    plot = matplotlib.axes.Axes.plot

    def record(self, x, y, **kw):
        lines.append((kw["label"], list(x), list(y)))
        return plot(self, x, y, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    png = decode_throughput.plot_from(str(tmp_path / "dt.json"))
    assert png == str(tmp_path / "dt.png") and (tmp_path / "dt.png").exists()
    assert lines == [
        ("bf16", [1024, 8192], [100.0, 80.0]),  # tokens/s
        ("fp4", [1024, 8192], [70.0, 72.0]),
        ("fp4", [1024, 8192], [0.7, 0.9]),  # ratio to bf16; bf16's own (1.0) is not drawn
    ]
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"variant": "bf16"}]}))
    with pytest.raises(ValueError, match=r"not a result written by experiments\.decode_throughput"):
        decode_throughput.plot_from(str(tmp_path / "other.json"))


def test_unknown_variant():
    with pytest.raises(ValueError, match="unknown variants"):
        decode_throughput.run(smoke_config(variants=("fp8",)), outdir="/tmp", name="x")
