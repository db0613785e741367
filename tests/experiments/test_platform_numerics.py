"""The quantizer's one float32 division, `scales.reciprocal`, per platform.

NVIDIA GPUs divide with the approximate `div.full.f32` under XLA and Pallas alike
(openxla/xla#37181; 13% of random reciprocals one ulp off on the H200,
experiments/results/gpu_division.md), which made NVFP4 codes differ between CPU and GPU in 1-2e-4
of elements. `scales.reciprocal` is therefore `numerics.reciprocal_rn`, correctly rounded on every
platform: on the CPU (XLA and the Pallas kernel in interpret mode) and, in the GPU test, on the
device, both must be numpy's IEEE quotient bit for bit.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import platform_numerics as config_module
from experiments import platform_numerics as pn
from trace_jax.fp4 import scales


def test_cpu_reciprocal_is_correctly_rounded():
    """Under jit on the CPU, XLA and the Pallas kernel in interpret mode: numpy's IEEE float32
    1 / d, bit for bit."""
    d = pn.divisors(1 << 16)
    with jax.default_device(jax.devices("cpu")[0]):
        xla = jax.jit(scales.reciprocal)(jnp.asarray(d))
        kernel = pn.pallas_reciprocal(jnp.asarray(d), interpret=True)
    np.testing.assert_array_equal(np.asarray(xla), np.float32(1) / d)
    np.testing.assert_array_equal(np.asarray(kernel), np.float32(1) / d)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_xla_and_pallas_reciprocals_are_ieee():
    """XLA's and the Pallas kernel's float32 reciprocals are numpy's IEEE ones on the GPU, where
    a plain division is `div.full.f32`."""
    row = pn.reciprocal_row(1 << 20)
    print(row)
    assert row["xla_vs_ieee"] == row["pallas_vs_ieee"] == row["pallas_vs_xla"] == 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the smoke run compares CPU with CPU")
def test_quick_run_on_the_cpu_finds_no_difference(tmp_path):
    """On a CPU-only machine both sides are the CPU: every count is zero, for both formats and
    both tensor kinds, and the results are written."""
    config = config_module.get_config("smoke")
    config.sections = ("reciprocal", "quantize")
    rows = pn.run(config, outdir=str(tmp_path), name="p")
    assert [r["check"] for r in rows] == ["reciprocal", *["quantize"] * 4]
    assert {(r["format"], r["tensor"].split()[0]) for r in rows[1:]} == {
        (f, k) for f in ("nvfp4", "mxfp4") for k in ("normal", "student_t3")
    }
    counts = [v for r in rows for k, v in r.items() if k.endswith(("_ieee", "_xla", "differ"))]
    assert len(counts) == 3 + 4 * 2 + 2 and not any(counts)
    assert all(r["max_abs_dequantized_diff"] == 0.0 for r in rows[1:])
    data = json.loads((tmp_path / "p.json").read_text())
    assert len(data["rows"]) == 5
    config.sections = ("division",)
    with pytest.raises(ValueError, match="unknown sections"):
        pn.run(config, outdir=str(tmp_path), name="p")


def test_one_ulp_in_the_reciprocal_changes_some_nvfp4_blocks():
    """The sensitivity check moves every reciprocal one ulp each way: on a million bf16 values
    some RTN codes and block scales change (midpoint ties of bf16 data are common), most do not;
    guided rounding keeps the rollout's codes (its scales are the rollout's, and a one-ulp move
    of x / scale leaves the rollout's code among the two neighbours, the one with its bit);
    `scales.reciprocal` is the IEEE one afterwards."""
    ieee = scales.reciprocal
    rows = pn.sensitivity_rows((256, 4096))
    assert scales.reciprocal is ieee
    moved = [f"sensitivity, {m}, reciprocals {u} ulp" for m in ("rtn", "guided") for u in "+-"]
    assert [r["check"] for r in rows] == [
        m.replace("+", "+1").replace("-", "-1") for m in moved
    ] * 2
    for r in rows:
        if "rtn" in r["check"]:
            assert 0 < r["codes_differ"] < r["elements"] // 100
            assert 0 < r["scales_differ"] < r["elements"] // 16 // 100
        else:  # the rollout's scales, and the neighbour with the rollout's bit is its code
            assert r["scales_differ"] == 0 and r["codes_differ"] == 0
