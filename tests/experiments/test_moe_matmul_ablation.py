"""The MoE matmul ablation runs its kernel bodies in interpret mode (timings are not checked: CPU
timings of interpreted kernels mean nothing); its product variants are checked inside `bench`
against the op's XLA reference, and each body lowers to Triton IR for an H200."""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings

import jax
import jax.numpy as jnp
import pytest

from configs import moe_matmul_ablation as config_module
from experiments import moe_matmul_ablation as abl


class SwappedPlanes(abl.KStep):
    """A K step whose activation planes come in the wrong order (the odd K columns meet the even
    weight plane): a wrong product that still lowers and runs."""

    def x(self, plane):
        return super().x(self.planes - 1 - plane)


def swapped_body(step, acc):
    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
    return abl.VARIANTS["full"].body(SwappedPlanes(**fields), acc)


def unlowerable_body(step, acc):  # stands in for a body Triton cannot lower
    raise RuntimeError("simulated lowering failure")


def test_smoke_run_times_every_case_and_records_failures(monkeypatch, tmp_path):
    """Every variant, the unhinted, the split-K and the several-experts-a-program cases get a timed
    row with the byte limit and the bf16 twin's ratio; the product variants match the reference;
    a wrong product and a body that fails are error rows without losing the others; the result
    files hold the rows."""
    full = abl.VARIANTS["full"]
    monkeypatch.setitem(abl.VARIANTS, "swapped", dataclasses.replace(full, body=swapped_body))
    monkeypatch.setitem(abl.VARIANTS, "broken", dataclasses.replace(full, body=unlowerable_body))
    config = config_module.get_config("smoke")
    config.variants = (*config.variants, "swapped", "broken")
    rows = abl.run(config, outdir=str(tmp_path), name="abl")

    by_case = {(r["variant"], r["hints"], r["split_k"], r["experts_per_program"]): r for r in rows}
    assert len(by_case) == len(rows)
    expected = {(v, True, 1, 1) for v in config.variants}
    expected |= {(v, False, 1, 1) for v in config.no_hints}
    expected |= {(v, True, s, 1) for v in config.split_k_variants for s in config.split_k}
    epp = config.experts_per_program
    expected |= {(v, True, 1, e) for v in config.experts_per_program_variants for e in epp}
    assert epp and set(by_case) == expected
    assert by_case["f16asm", True, 1, epp[0]]["block"].endswith(f" e{epp[0]}")
    assert "differs from the reference" in by_case["swapped", True, 1, 1]["error"]
    assert "simulated lowering failure" in by_case["broken", True, 1, 1]["error"]

    g, k, n = config.experts, config.d_model, config.d_ff
    codes, scales, bf16 = g * n * k // 2, g * n * k // 16, 2 * g * n * k
    read_bw = json.loads((tmp_path / "abl.json").read_text())["ceilings"]["read_bw"]
    for key, row in by_case.items():
        variant = key[0]
        if variant in ("swapped", "broken"):
            continue
        assert "error" not in row, row
        spec = abl.VARIANTS[variant]
        weight_bytes = bf16 if spec.layout == "bf16" else codes + scales * spec.reads_scales
        assert row["bytes"] == weight_bytes
        assert row["us"] > 0 and row["GBps"] == pytest.approx(row["bytes"] / row["us"] / 1e3)
        assert row["x_limit"] == pytest.approx(row["us"] * 1e-6 * read_bw / row["bytes"])
        assert row["x_limit"] == pytest.approx(row["us"] / row["limit_us"])
        assert ("vs_bf16w" in row) == (variant != "bf16w")
        assert row["loop_us"] > 0  # timed again inside one device loop
        assert row["loop_x_limit"] == pytest.approx(row["loop_us"] / row["limit_us"])
        # The decodes are right: full, f16, f16asm (its jnp form here), full32, split-K.
        assert ("rel_err" in row) == spec.product
        if spec.product:
            assert row["rel_err"] < 1e-5

    saved = json.loads((tmp_path / "abl.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert saved["shape"]["experts"] == g
    assert saved["ceilings"]["loop_floor_us"] > 0
    best = {r["variant"]: r for r in saved["best_by_variant"]}
    assert set(best) == set(abl.VARIANTS) - {"swapped", "broken"}  # rows with errors: no time
    for variant, r in best.items():
        timed = [row["us"] for row in rows if row["variant"] == variant]
        assert r["us"] == min(timed)
        assert r["vs_best_bf16w"] == pytest.approx(r["us"] / best["bf16w"]["us"])
    table = (tmp_path / "abl.md").read_text()
    assert "| variant | hints | split_k |" in table and "| error |" in table.splitlines()[5]
    assert "Each variant's fastest row:" in table and "| vs_best_bf16w |" in table


def test_unknown_variants_and_tiles_are_refused():
    config = config_module.get_config("smoke")
    config.no_hints = ("fulll",)
    with pytest.raises(ValueError, match="unknown variant 'fulll'; expected one of"):
        abl.cases(config)
    with pytest.raises(ValueError, match="give each of the 8 planes of 'full32' >= 16 columns"):
        abl.check_case(abl.Case("full32", 64, 64, 4, 3), 2, 256, 128)
    with pytest.raises(ValueError, match="block_k=128 x split_k=4 must divide K=256"):
        abl.check_case(abl.Case("full", 64, 128, 4, 3, split_k=4), 2, 256, 128)
    with pytest.raises(ValueError, match="experts_per_program=4 must divide G=2"):
        abl.check_case(abl.Case("full", 64, 128, 4, 3, experts_per_program=4), 2, 256, 128)


LOWERED = [(v, True, 1, 1) for v in abl.VARIANTS]
LOWERED += [("stream", False, 1, 1), ("full", False, 2, 1), ("f16asm", True, 1, 2)]


@pytest.mark.parametrize("variant, hints, split_k, experts_per_program", LOWERED)
def test_every_body_lowers_through_triton_without_a_gpu(
    h200_triton_lowering, variant, hints, split_k, experts_per_program
):
    """Each body, inline PTX included, lowers to Triton IR for an H200 (a body Triton cannot
    lower would cost a GPU run to find out)."""
    g, k, n, r = 2, 256, 128, 16
    spec = abl.VARIANTS[variant]
    planes = abl.WEIGHT_LAYOUTS[spec.layout]
    w_dtype = {"u8": jnp.uint8, "u32": jnp.uint32, "bf16": jnp.bfloat16}[spec.layout]
    args = (
        jax.ShapeDtypeStruct((g, n, k // planes), w_dtype),
        jax.ShapeDtypeStruct((g, n, k // 16), jnp.uint8),
        jax.ShapeDtypeStruct((planes, g * r, k // planes), spec.dtype),
        jax.ShapeDtypeStruct((g,), jnp.float32),
    )
    case = abl.Case(variant, 64, 128, 4, 3, hints, split_k, experts_per_program)
    op = functools.partial(abl.run_case, case=case, interpret=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        lowered = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text
