"""fp4_quantize (interpret mode on the CPU) against the trace_jax.fp4 reference, bit for bit."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.common import Implementation
from kernels_pallas.fp4_quantize import (
    fp4_quantize,
    fp4_quantize_with_implementation,
    quantize_capture_reference,
)
from trace_jax import fp4

# One worker runs the module: its cases share compiled kernels and references.
pytestmark = [
    pytest.mark.usefixtures("pallas_interpreted_on_cpu"),
    pytest.mark.xdist_group("fp4_quantize"),
]


def _assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb, strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        u, v = np.asarray(u), np.asarray(v)
        if u.dtype.itemsize == 1:  # float8 scales by their bits (numpy sees no NaN in them)
            u, v = u.view(np.uint8), v.view(np.uint8)
        np.testing.assert_array_equal(u, v)


def _x(shape, seed, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.t(k1, 3.0, shape) * jnp.exp(jax.random.normal(k2, (*shape[:-1], 1)) * 2)
    x = x.reshape(-1, shape[-1]).at[0, :32].set(0.0).reshape(shape)  # an all-zero block
    return x.astype(dtype)


def _with_nonfinite(x):
    """`x` with NaN, +Inf, -Inf and 1e30 in four of its rows (a diverged trainer's input)."""
    return x.at[1, 5].set(jnp.nan).at[2, 70].set(jnp.inf).at[3, 0].set(-jnp.inf).at[4, 33].set(1e30)


def _assert_nan_where_rtn(out, x, fmt):
    """The capture dequantizes to NaN exactly where RTN of `x` does (RTN's NaN policy)."""
    got = np.isnan(np.asarray(fp4.dequantize(out.qtensor())))
    want = np.isnan(np.asarray(fp4.dequantize(fp4.quantize(x, fmt))))
    assert want.any() and not want.all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((5, 64), jnp.float32), ((3, 7, 128), jnp.bfloat16), ((1, 256), jnp.float32)],
)
def test_rtn_capture_matches_reference(fmt, shape, dtype):
    x = _x(shape, seed=sum(shape), dtype=dtype)
    out, ran = fp4_quantize_with_implementation(x, fmt, implementation="pallas", block_r=4)
    assert ran is Implementation.PALLAS
    ref = quantize_capture_reference(x, fmt)
    _assert_same(out, ref)
    # The capture is exactly the compact guidance of the quantizer's own QTensor.
    q = fp4.quantize(x, fmt)
    _assert_same(out.compact_guidance(), fp4.make_guidance(q, "compact"))
    for mode in ("compact", "full"):
        _assert_same(out.guidance(mode), fp4.make_guidance(q, mode))
    _assert_same(out.qtensor(), q)


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", ["full", "compact"])
def test_guided_matches_reference(fmt, mode):
    x = _x((6, 128), seed=3)
    noise = jax.random.normal(jax.random.key(9), x.shape)
    g = fp4.make_guidance(fp4.quantize(x * (1 + 0.02 * noise), fmt), mode)
    x = _with_nonfinite(x)
    out = fp4_quantize(x, fmt, guidance=g, implementation="pallas", block_r=4)
    _assert_same(out, quantize_capture_reference(x, fmt, guidance=g))
    _assert_nan_where_rtn(out, x, fmt)
    own = fp4.quantize(x, fmt)
    assert not np.array_equal(np.asarray(out.qtensor().codes), np.asarray(own.codes))


def test_non_power_of_two_rows_fall_back_to_xla():
    """The kernel tiles power-of-two rows only: "pallas" alone refuses N = 96, the order
    ("pallas", "xla") falls back to the reference, as does the default."""
    x = _x((4, 96), seed=1)
    with pytest.raises(NotImplementedError, match="N=96"):
        fp4_quantize(x, fp4.NVFP4, implementation="pallas")
    for implementation in (("pallas", "xla"), None, "xla"):
        out, ran = fp4_quantize_with_implementation(x, fp4.NVFP4, implementation=implementation)
        assert ran is Implementation.XLA
        _assert_same(out, quantize_capture_reference(x, fp4.NVFP4))


def test_default_is_the_reference_off_gpu(monkeypatch):
    """implementation=None: the reference off a GPU, the kernel first on one."""
    from kernels_pallas import common

    x = _x((4, 64), seed=2)
    monkeypatch.setattr(common, "kernel_platform", lambda: "cpu")
    assert fp4_quantize_with_implementation(x, fp4.MXFP4)[1] is Implementation.XLA
    monkeypatch.setattr(common, "kernel_platform", lambda: "gpu")
    out, ran = fp4_quantize_with_implementation(x, fp4.MXFP4, interpret=True)
    assert ran is Implementation.PALLAS
    _assert_same(out, quantize_capture_reference(x, fp4.MXFP4))


def test_bad_inputs():
    with pytest.raises(ValueError, match="packs FP4 codes"):
        fp4_quantize(jnp.ones((2, 64)), "mxfp8")
    with pytest.raises(ValueError, match="multiple of the block size"):
        fp4_quantize(jnp.ones((2, 40)), "nvfp4")
    with pytest.raises(ValueError, match="floating-point"):
        fp4_quantize(jnp.ones((2, 64), jnp.int32), "nvfp4")
    g = fp4.make_guidance(fp4.quantize(jnp.ones((3, 64)), "nvfp4"))
    with pytest.raises(ValueError, match="cannot guide"):
        fp4_quantize(jnp.ones((2, 64)), "nvfp4", guidance=g)
    with pytest.raises(ValueError, match=r"implementation must be None, one of .* got 'cuda'"):
        fp4_quantize(jnp.ones((2, 64)), "nvfp4", implementation="cuda")
    with pytest.raises(ValueError, match="empty sequence"):
        fp4_quantize(jnp.ones((2, 64)), "nvfp4", implementation=())


@pytest.mark.parametrize(
    ("fmt", "mode", "pack"),
    # Every format and mode; the packings (bit layouts, independent of both: tested alone in
    # `test_split_packing_puts_field_j_at_bit_j_times_width`) alternate.
    [
        (fmt, mode, pack)
        for (fmt, mode), pack in zip(
            itertools.product([fp4.NVFP4, fp4.MXFP4], [None, "compact", "full"]),
            itertools.cycle(["sum", "split"]),
            strict=False,
        )
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_column_tiles_match_reference(fmt, mode, pack):
    # block_n = 64 splits each 256-wide row over 4 programs: an NVFP4 row's global scale must
    # come from the whole row, not the tile (the rows' magnitudes differ by orders: _x).
    x = _x((6, 256), seed=11)
    g = None
    if mode is not None:
        noise = jax.random.normal(jax.random.key(4), x.shape)
        g = fp4.make_guidance(fp4.quantize(x * (1 + 0.02 * noise), fmt), mode)
    x = _with_nonfinite(x)
    out, ran = fp4_quantize_with_implementation(
        x, fmt, guidance=g, implementation="pallas", block_r=2, block_n=64, pack=pack
    )
    assert ran is Implementation.PALLAS
    _assert_same(out, quantize_capture_reference(x, fmt, guidance=g))
    _assert_nan_where_rtn(out, x, fmt)
    with pytest.raises(ValueError, match="block_n"):
        fp4_quantize(x, fmt, implementation="pallas", block_n=48)


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
def test_default_launch_of_wide_and_narrow_rows(fmt, monkeypatch):
    # The fastest launches measured on the H200: wide NVFP4 rows walked in chunks by a row loop
    # (global scale inside the kernel), other rows wider than COLUMN_TILE in column tiles,
    # narrower rows whole. The widths are lowered so interpret mode stays quick.
    from kernels_pallas.fp4_quantize import api

    launches = []
    kernel = api.quantize_capture_pallas

    def spy(*args, **kwargs):
        launches.append((kwargs["block_r"], kwargs["block_n"], kwargs["loop_n"]))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(api, "quantize_capture_pallas", spy)
    monkeypatch.setattr(api, "COLUMN_TILE", 64)
    monkeypatch.setattr(api, "ROW_LOOP_CHUNK", 128)
    x = _x((5, 256), seed=12)
    _assert_same(fp4_quantize(x, fmt, implementation="pallas"), quantize_capture_reference(x, fmt))
    mid = x[:, :128]  # a column tile's width, not the row loop's
    _assert_same(
        fp4_quantize(mid, fmt, implementation="pallas"), quantize_capture_reference(mid, fmt)
    )
    narrow = x[:, :64]
    _assert_same(
        fp4_quantize(narrow, fmt, implementation="pallas"), quantize_capture_reference(narrow, fmt)
    )
    wide = (
        (api.ROW_LOOP_ROWS, None, 128) if fmt.has_global_scale else (api.COLUMN_TILE_ROWS, 64, None)
    )
    assert launches == [
        wide,
        (api.COLUMN_TILE_ROWS, 64, None),
        (min(16, api.TILE_ELEMENTS // 64), None, None),
    ]


@pytest.mark.parametrize("per_byte", [2, 8])
def test_split_packing_puts_field_j_at_bit_j_times_width(per_byte):
    """Both packings against a numpy packing of random fields (independent of either)."""
    from kernels_pallas.fp4_quantize import kernel

    width = 8 // per_byte
    fields = np.random.default_rng(per_byte).integers(0, 1 << width, (3, 64))
    want = (fields.reshape(3, -1, per_byte) << (width * np.arange(per_byte))).sum(-1)
    for pack in kernel.PACKINGS.values():
        got = pack(jnp.asarray(fields, jnp.uint8), per_byte)
        assert got.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="pack must be one of"):
        fp4_quantize(_x((2, 64), seed=1), fp4.MXFP4, implementation="pallas", pack="shift")


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", [None, "compact", "full"])
def test_row_loop_matches_reference(fmt, mode):
    # loop_n = 64 walks each 256-wide row in 4 chunks: the NVFP4 global scale must come from all
    # of them (rows whose largest |x| sits in different chunks: _x scales rows by orders).
    x = _x((6, 256), seed=13)
    x = x.at[1, 200].set(50.0).at[2, 3].set(-70.0)
    g = None
    if mode is not None:
        noise = jax.random.normal(jax.random.key(5), x.shape)
        g = fp4.make_guidance(fp4.quantize(x * (1 + 0.02 * noise), fmt), mode)
    x = _with_nonfinite(x)
    out = fp4_quantize(x, fmt, guidance=g, implementation="pallas", block_r=2, loop_n=64)
    _assert_same(out, quantize_capture_reference(x, fmt, guidance=g))
    _assert_nan_where_rtn(out, x, fmt)
    with pytest.raises(ValueError, match="loop_n"):
        fp4_quantize(x, fmt, implementation="pallas", loop_n=48)
    with pytest.raises(ValueError, match="without block_n"):
        fp4_quantize(x, fmt, implementation="pallas", loop_n=64, block_n=128)
