"""The decode-attention benchmark: its launch sweep, and its CPU smoke configuration end to end
(interpret mode; timings not checked, errors against the references are)."""

from __future__ import annotations

import json

import pytest

from configs import bench_decode_attention as config_module
from experiments import bench_decode_attention as bench

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def test_smoke_run_reports_the_fastest_fp4_and_bf16_variants(tmp_path):
    config = config_module.get_config("smoke")
    (row,) = bench.run(config, outdir=str(tmp_path), name="attn")
    assert (row["shape"], row["context"]) == ("smoke", 256)
    assert list(row["fp4_ms_by_variant"]) == [row["fp4_variant"]]  # the default launch only
    assert row["fp4_ms"] == row["fp4_ms_by_variant"][row["fp4_variant"]] > 0
    assert set(row["bf16_ms"]) == {"xla einsum", "bf16 twin"}  # jax's gqa is GPU-only
    assert row["best_bf16_ms"] == min(row["bf16_ms"].values()) == row["bf16_ms"][row["best_bf16"]]
    assert row["speedup_vs_best_bf16"] == pytest.approx(row["best_bf16_ms"] / row["fp4_ms"])
    # FP4 against the XLA reference over the same packed cache, and the bf16 twin against plain
    # XLA attention: float rounding only.
    assert 0 < row["fp4_rel_err_vs_reference"] < 1e-2 and 0 < row["bf16_twin_rel_err_vs_xla"] < 1e-2
    saved = json.loads((tmp_path / "attn.json").read_text())
    assert saved["summary"]["bandwidth_fraction"] == {"smoke@256": row["fp4_bandwidth_fraction"]}
    assert saved["summary"]["speedup_vs_best_bf16_at_32k_plus"] == {}


def test_launch_sweep():
    """The default launch first, each launch once, p . v in the other order than the default's,
    and the wider grid only where tuned."""
    plain = bench.launches(16, 4, 128, 32768, tuned=False)
    tuned = bench.launches(16, 4, 128, 32768, tuned=True)
    assert plain[0] == ("f16", None, 4, None, None, None)
    assert len(set(plain)) == len(plain) and len(set(tuned)) == len(tuned)
    assert tuned[: len(plain)] == plain and len(tuned) > len(plain)
    assert all(len(v) == 6 for v in tuned)
    # head_dim 128 transposes p . v by default: the sweep times the untransposed order too.
    assert {v[5] for v in plain} == {None, False}
    assert {v[5] for v in bench.launches(16, 2, 64, 4096, tuned=False)} == {None, True}
