"""The quantize ablation runs its cut-down kernels in interpret mode (CPU timings of interpreted
kernels mean nothing, so numbers are not checked); its `full` stage is the production kernel,
checked bit for bit inside `bench`, and the cut-down stages do the work they are named for."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import quantize_ablation as config_module
from experiments import quantize_ablation as abl
from kernels_pallas.fp4_quantize import api
from trace_jax import fp4
from trace_jax.fp4 import scales

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")

FORMATS = [fp4.MXFP4, fp4.NVFP4]


def test_every_stage_runs_and_a_failing_stage_is_recorded(monkeypatch):
    def broken(*args, **kwargs):  # stands in for a body Triton cannot lower
        raise RuntimeError("simulated lowering failure")

    monkeypatch.setitem(abl.BODIES, "scales", broken)
    rows = abl.bench(config_module.get_config("smoke"))
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {
        "copy of x",
        *(f"{f.name} {s}" for f in FORMATS for s in abl.STAGES),
        *(f"{f.name} full, sum packing" for f in FORMATS),
        "mxfp4 API (whole rows)",  # smoke rows (256) are not wider than a column tile
        "nvfp4 API (whole rows)",
    }
    for f in FORMATS:
        assert "simulated lowering failure" in by_variant[f"{f.name} scales"]["error"]
        assert "added_ms" not in by_variant[f"{f.name} round"]  # the stage before it failed
        assert "added_ms" in by_variant[f"{f.name} full"]
        for s in ("io", "round", "full", "full, sum packing"):
            assert by_variant[f"{f.name} {s}"]["ms"] > 0
        assert "added_ms" not in by_variant[f"{f.name} full, sum packing"]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_stages_do_the_work_they_are_named_for(fmt):
    x = (3.0 * jax.random.normal(jax.random.key(4), (8, 256))).astype(jnp.bfloat16)
    want = api.fp4_quantize(x, fmt, implementation="xla")
    s_g = scales.global_scale(x.astype(jnp.float32), fmt, (1,)) if fmt.has_global_scale else None
    run = functools.partial(abl.run_stage, fmt=fmt, block_r=2, block_n=128, interpret=True)
    want_bits = np.asarray(scales.to_bits(want.scales))
    codes = np.asarray(fp4.unpack_fp4(want.packed_codes)).astype(np.int64)
    assert len(np.unique(codes)) > 8  # random data: many codes
    packed, bits, cbits = run(x, s_g, stage="full")
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(want.packed_codes))
    np.testing.assert_array_equal(np.asarray(cbits), np.asarray(want.compact_bits))
    np.testing.assert_array_equal(np.asarray(bits), want_bits)
    for stage in ("scales", "round"):  # the real scale bits, written
        np.testing.assert_array_equal(np.asarray(run(x, s_g, stage=stage)[1]), want_bits)
    # `round` computes the real codes: each column tile's code sum, mod 256, fills its bytes.
    packed, _, cbits = (np.asarray(a) for a in run(x, s_g, stage="round"))
    tile_sums = codes.reshape(8, 2, 128).sum(-1) % 256  # two 128-column tiles per row
    np.testing.assert_array_equal(packed.reshape(8, 2, 64), np.repeat(tile_sums[..., None], 64, -1))
    np.testing.assert_array_equal(cbits.reshape(8, 2, 16), np.repeat(tile_sums[..., None], 16, -1))
    io_bits = np.asarray(run(x, s_g, stage="io")[1]).reshape(8, 2, -1)
    assert (io_bits == io_bits[..., :1]).all()  # a per-tile constant: no scale work


@pytest.mark.parametrize("stage, pack", [*((s, "split") for s in abl.STAGES), ("full", "sum")])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_stage_lowers_through_triton_without_a_gpu(h200_triton_lowering, fmt, stage, pack):
    """Each body lowers to Triton IR for an H200 with the default column tiles (a body Triton
    cannot lower would cost a GPU run to find out)."""
    x = jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16)
    s_g = jax.ShapeDtypeStruct((16, 1), jnp.float32) if fmt.has_global_scale else None
    op = functools.partial(
        abl.run_stage, fmt=fmt, stage=stage, interpret=False,
        block_r=api.COLUMN_TILE_ROWS, block_n=api.COLUMN_TILE, pack=pack,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        lowered = jax.jit(op).trace(x, s_g).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
