"""The grouped matmul benchmark in its CPU smoke configuration (interpret mode): every kernel and
the dense matmul per phase, the Pallas sweeps with a failing block config recorded and skipped,
a kernel whose every config fails, and the weights' decode pass (XLA beside Pallas); outputs
checked against the float32 product or the XLA decode (timings are not checked)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from configs import bench_moe_matmul as config_module
from experiments import bench_moe_matmul as bench

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def test_smoke_run_times_every_kernel_and_records_failing_configs(tmp_path):
    config = config_module.get_config("smoke")
    rows = bench.run(config, outdir=str(tmp_path), name="moe")
    kernels = [*bench.KERNELS, bench.DENSE]
    phase_rows = [r for r in rows if r["phase"] != "weights_decode"]
    assert [(r["phase"], r["M"], r["kernel"]) for r in phase_rows] == [
        (phase, m, k) for phase, m in (("decode", 24), ("prefill", 96)) for k in kernels
    ]
    # The decode pass alone, XLA beside Pallas, for each 16-bit dtype: the Pallas pass's bits are
    # the XLA fusion's, its limit the bytes (codes, scales, 2 bytes a value) at the copy rate.
    decode_rows = {r["kernel"]: r for r in rows if r["phase"] == "weights_decode"}
    assert sorted(decode_rows) == sorted(
        f"decode_{impl}_{dtype}" for impl in ("xla", "pallas") for dtype in ("float16", "bfloat16")
    )
    decode_bytes = 4 * 64 * 64 * (2 + 1 / 2 + 1 / 16)  # float16 out, codes, E4M3 scales
    copy_bw = json.loads((tmp_path / "moe.json").read_text())["ceilings"]["copy_bw"]
    for r in decode_rows.values():
        assert r["bit_exact_vs_xla"] and r["bytes_GB"] == pytest.approx(decode_bytes / 1e9)
        assert r["byte_limit_ms"] == pytest.approx(1e3 * decode_bytes / copy_bw)
        assert r["byte_limit_ratio"] == pytest.approx(r["ms"] / r["byte_limit_ms"])
    saved = json.loads((tmp_path / "moe.json").read_text())
    sweeps = saved["sweep"]
    by = {(r["phase"], r["kernel"]): r for r in phase_rows}
    for (phase, kernel), r in by.items():
        assert (r["G"], r["K"], r["N"]) == (4, 64, 64)
        if (phase, kernel) == ("prefill", "pallas_bf16"):  # its only config fails
            assert "ms" not in r and r["block_config"] is None and "failed" in r["error"]
            continue
        dense = by[(phase, bench.DENSE)]
        assert r["tflops"] == pytest.approx(2 * r["M"] * 64 * 64 / r["ms"] / 1e9)
        assert r["frac_of_dense"] == pytest.approx(r["tflops"] / dense["tflops"])
        assert r["byte_limit_ratio"] == pytest.approx(r["ms"] / r["byte_limit_ms"])
        assert r["vs_ragged_dot"] == pytest.approx(by[(phase, "ragged_dot")]["ms"] / r["ms"])
        # Timed again inside one device loop, beside the loop's own cost per call.
        assert r["loop_ms"] > 0 and r["loop_floor_ms"] > 0
        assert r["loop_byte_limit_ratio"] == pytest.approx(r["loop_ms"] / r["byte_limit_ms"])
        if kernel != bench.DENSE:
            # bf16 outputs of the same operands: one bf16 rounding (2**-9) over float32 sums.
            assert 0 < r["rel_err"] < 2**-8
        if kernel in bench.SWEPT:
            best = min((e for e in sweeps[phase][kernel] if "ms" in e), key=lambda e: e["ms"])
            assert r["block_config"] == best["config"]
    failed = [e for e in sweeps["decode"]["pallas_bf16"] if "error" in e]
    assert [e["config"] for e in failed] == [{"block_n": 48}]
    assert "block_n must be a power of two >= 16, got 48" in failed[0]["error"]
    assert by[("decode", "fp4_nvfp4_act")]["block_config"]["grid"] == "row_tiles"
    assert saved["summary_ms"]["prefill"]["pallas_bf16"] is None
    assert set(saved["summary_ms"]["weights_decode"]) == set(decode_rows)
    # Each FP4 kernel beside its predecoded twin, on the same operands, whatever the op's default.
    ops = bench.operands(config, 96)
    for kernel in bench.FP4:
        (fn, args), (twin_fn, twin_args) = (
            bench.kernel_call(k, ops) for k in (kernel, f"{kernel}_predecoded")
        )
        assert (fn.keywords["predecode"], twin_fn.keywords["predecode"]) == (False, True)
        assert all(a is b for a, b in zip(args, twin_args, strict=True))
    assert saved["ceilings"]["read_bw"] > 0


def test_default_tiles_variant_times_each_kernel_at_its_defaults_at_decode_and_prefill():
    config, sweep = config_module.get_config("default_tiles"), config_module.get_config()
    assert [p for p, _ in config.phases] == ["decode", "prefill"]
    assert dict(config.phases) == {p: m for p, m in sweep.phases if p in ("decode", "prefill")}
    for phase, _ in config.phases:
        kernels = config.block_configs[phase]
        assert set(kernels) == set(sweep.block_configs[phase]) == set(bench.SWEPT)
        for kernel, configs in kernels.items():  # the FP4 kernel in every decode layout
            fp4 = kernel in bench.FP4
            assert tuple(configs) == (({}, *config_module.DECODE_LAYOUTS) if fp4 else ({},))
    assert sorted(config.to_dict()) == sorted(sweep.to_dict())  # overrides stay valid


def test_predecoded_kernels_loop_over_their_packed_weights():
    # Each predecoded call decodes the weights (argument 1); its device loop must carry them, or
    # XLA hoists that decode out of the loop and `loop_ms` times the bf16 kernel alone.
    config = config_module.get_config("smoke")
    ops = bench.operands(config, 16)
    for name in bench.SWEPT:
        _, args = bench.kernel_call(name, ops)
        carried = args[bench.LOOP_CARRY_ARG.get(name, 0)]
        assert carried is (ops["packed"] if name in bench.PREDECODED else args[0]), name


def test_routing_skew_sends_more_rows_to_the_first_experts():
    """Uniform routing (skew 0) keeps the group sizes drawn before; a Zipf skew of 1 over 8
    experts sends expert e about 1 / (e + 1) of the first's rows: the sizes' shares are within
    sampling noise of (e + 1) ** -1 / H_8, far from uniform's 1/8."""
    config = config_module.get_config("smoke")
    config.experts = 8
    m = 4096
    uniform = np.asarray(bench.operands(config, m)["sizes"])
    groups = jax.random.randint(jax.random.key(9), (m,), 0, 8)
    np.testing.assert_array_equal(uniform, np.bincount(np.asarray(groups), minlength=8))
    config.routing_skew = 1.0
    sizes = np.asarray(bench.operands(config, m)["sizes"])
    assert sizes.sum() == m
    expected = 1.0 / np.arange(1, 9)
    expected /= expected.sum()
    # binomial standard error of a share at m = 4096 rows is at most 0.008; allow 4 of them
    np.testing.assert_allclose(sizes / m, expected, atol=0.032)
    assert sizes[0] > 2 * m / 8  # the busiest expert holds over twice the uniform share
