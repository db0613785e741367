"""The decode-step benchmark in its CPU smoke configuration: every variant timed in alternating
rounds, and the row's medians, ratios and wall-time parts derived from them (CPU timings of
interpreted kernels mean nothing, so only their relations are checked)."""

from __future__ import annotations

import json

import pytest

from configs import bench_decode_step as config_module
from experiments import bench_decode_step as bench

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def test_smoke_run_writes_one_row_per_context(tmp_path):
    config = config_module.get_config("smoke")
    config.implementations = ("pallas",)  # the XLA variant adds a compile, not a code path
    (step,) = bench.run(config, outdir=str(tmp_path), name="step")
    saved = json.loads((tmp_path / "step.json").read_text())
    assert saved["rows"] == json.loads(json.dumps([step]))
    assert (step["preset"], step["context"], step["batch"]) == ("tiny", 64, 2)
    variants = ["bf16", *(f"fp4_pallas_{v}" for v in ("no capture", "compact", "full"))]
    # Where the command's time went, part by part, in order.
    parts = ["fill bf16", "fill fp4", *(f"compile {v}" for v in variants), "timing"]
    assert list(step["wall_s_by_part"]) == parts
    assert all(t > 0 for t in step["wall_s_by_part"].values())
    assert list(step["ms_by_round"]) == variants and step["rounds"] == 1
    for v in variants:
        assert step[f"{v}_ms"] == step["ms_by_round"][v][0] > 0
    by_round = step["ms_by_round"]
    no_capture = by_round["fp4_pallas_no capture"][0]
    assert step["fp4_pallas_compact_overhead"] == pytest.approx(
        by_round["fp4_pallas_compact"][0] / no_capture - 1
    )
    assert step["fp4_pallas_speedup_vs_bf16"] == pytest.approx(by_round["bf16"][0] / no_capture)
    assert saved["summary"]["speedup_vs_bf16"] == {"64": step["fp4_pallas_speedup_vs_bf16"]}
    assert "SMOKE RUN" in (tmp_path / "step.md").read_text()


@pytest.mark.parametrize("implementations", [("xla",), ("pallas", "mosaic")])
def test_decode_step_needs_the_pallas_implementation(implementations):
    config = config_module.get_config("smoke")
    config.implementations = implementations
    with pytest.raises(ValueError, match="must include 'pallas' and be among xla, pallas"):
        bench.DecodeStepBench(config)
