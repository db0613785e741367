"""The prefill-attention benchmark in its CPU smoke configuration (the kernels interpreted): XLA's
attention, the kernel and the two library baselines per shape (cuDNN's recorded as failing on the
CPU), the failing tiling recorded and skipped, the FLOP count and ratios derived from the times
(the times themselves are not checked), outputs against XLA's."""

from __future__ import annotations

import json

import pytest

from configs import bench_prefill_attention as config_module
from experiments import bench_prefill_attention as bench

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


@pytest.mark.filterwarnings("ignore:jax.experimental.pallas.ops.gpu.attention is deprecated")
def test_smoke_run_times_every_kernel_and_records_failures(tmp_path):
    config = config_module.get_config("smoke")
    rows = bench.run(config, outdir=str(tmp_path), name="prefill")
    assert [(r["rows"], r["prompt"], r["slots"], r["kernel"]) for r in rows] == [
        (2, 24, 32, kernel) for kernel in ("xla", "pallas", "cudnn", "jax_mha")
    ]
    saved = json.loads((tmp_path / "prefill.json").read_text())
    sweep = saved["sweep"]["(2, 24, 8)"]
    assert [e["tiling"] for e in sweep] == [dict(t) for t in config.tilings]
    assert "block_s must be a power of two >= 16, got 48" in sweep[2]["error"]
    xla, pallas, cudnn, jax_mha = rows
    assert pallas["tiling"] in [e["tiling"] for e in sweep[:2]]
    assert "ms" not in cudnn and cudnn["error"]  # no cuDNN on the CPU: recorded, not timed
    # 4 Dh FLOPs per query head and visible (query, slot) pair: 24 * 25 / 2 pairs per row.
    flops = 4 * 32 * 4 * 2 * (24 * 25 / 2)
    for r in (xla, pallas, jax_mha):
        assert r["tflops"] == pytest.approx(flops / (r["ms"] / 1e3) / 1e12)
        assert r["frac_of_dense"] == pytest.approx(r["tflops"] / saved["dense_tflops"])
        assert r["speedup_vs_xla"] == pytest.approx(xla["ms"] / r["ms"])
    # bf16 outputs of the same attention, rounded differently: well within bf16's 2**-8.
    assert 0 < pallas["rel_err"] < 2**-7 and 0 < jax_mha["rel_err"] < 2**-7


def test_causal_flops_count_the_visible_pairs():
    config = config_module.get_config()
    assert bench.causal_flops(config, 1, 8192) == 4 * 128 * 32 * 8192 * 8193 / 2
