"""The kernel benchmark runs end to end in its CPU smoke mode (numbers are not checked)."""

from __future__ import annotations

import json

import pytest

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
    # Each decode-step row says where the command's time went, part by part, and keeps every
    # round's times; its medians and ratios come from them.
    (step,) = [r for r in data["rows"] if r["section"] == "decode_step"]
    variants = ["bf16", "fp4_xla_no capture"]
    variants += [f"fp4_pallas_{v}" for v in ("no capture", "compact", "full")]
    parts = ["fill bf16", "fill xla", "fill pallas", *(f"compile {v}" for v in variants)]
    assert list(step["wall_s_by_part"]) == [*parts, "timing"]
    assert all(t > 0 for t in step["wall_s_by_part"].values())
    assert list(step["ms_by_round"]) == variants and step["rounds"] == 1
    for v in variants:
        assert step[f"{v}_ms"] == step["ms_by_round"][v][0] > 0
    by_round = step["ms_by_round"]
    compact = by_round["fp4_pallas_compact"][0] / by_round["fp4_pallas_no capture"][0] - 1
    assert step["fp4_pallas_compact_overhead"] == pytest.approx(compact)


def test_mark_fastest_marks_the_quickest_launch_only():
    rows = [{"launch": "a", "ms": 2.0}, {"launch": "b", "ms": 0.5}, {"launch": "c", "ms": 0.9}]
    marked = bench_kernels.mark_fastest(rows)
    assert [r["fastest"] for r in marked] == [False, True, False]
    assert [r["launch"] for r in marked] == ["a", "b", "c"]


def _step_row(context: int, ms: float, measured_by: str) -> dict:
    """A decode-step row with the fields the summary reads (numbers are test data)."""
    return {
        "section": "decode_step",
        "measured_by": measured_by,
        "context": context,
        "bf16_ms": 2 * ms,
        "fp4_pallas_no capture_ms": ms,
        "fp4_pallas_speedup_vs_bf16": 2.0,
        "fp4_pallas_compact_overhead": 0.01 * context / 4096,
        "fp4_pallas_full_overhead": 0.02,
    }


def test_keep_from_merges_decode_step_rows_by_context(tmp_path):
    """A decode-step run over some contexts replaces those rows of the earlier results, keeps the
    others (with their provenance named in the notes), and orders the rows by context; sections
    without merge keys are replaced whole."""
    earlier = [_step_row(c, 1.0, "`old` (day 1)") for c in (4096, 32768, 131072)]
    earlier.append({"section": "moe", "phase": "decode", "measured_by": "`old` (day 1)"})
    new = [_step_row(c, 0.5, "`new` (day 2)") for c in (65536, 32768)]
    merged = bench_kernels.merge_rows("decode_step", earlier, new)
    assert [r["context"] for r in merged] == [4096, 32768, 65536, 131072]
    assert [r["measured_by"] for r in merged] == ["`old` (day 1)", *["`new` (day 2)"] * 2,
                                                  "`old` (day 1)"]  # fmt: skip
    assert bench_kernels.merge_rows("moe", earlier, []) == []

    ceil = {"read_bw": 4e12, "copy_bw": 3e12}
    summary, _, notes = bench_kernels._write(
        {"decode_step": merged}, ceil, {}, True, str(tmp_path), "k", {"rows": earlier}
    )
    assert set(summary["decode_step_speedup"]) == {"4096", "32768", "65536", "131072"}
    assert "Section decode_step (rows 4096, 131072) is kept from an earlier run, `old`" in notes
    data = json.loads((tmp_path / "k.json").read_text())
    assert [r["context"] for r in data["rows"]] == [4096, 32768, 65536, 131072]


def test_decode_step_needs_the_pallas_backend():
    with pytest.raises(ValueError, match="must include 'pallas'"):
        bench_kernels.bench_decode_step(True, [64], backends=("xla",))
