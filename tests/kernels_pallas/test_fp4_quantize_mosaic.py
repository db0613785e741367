"""The Mosaic (TPU) fp4_quantize kernel in TPU interpret mode, bit for bit against trace_jax.fp4;
its reciprocal estimate; its lowering for a TPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.fp4_quantize import kernel, mosaic, quantize_capture_reference
from trace_jax import fp4
from trace_jax.fp4 import numerics
from trace_jax.fp4.scales import to_bits

INTERPRET = pltpu.InterpretParams()


def _x(shape, seed, dtype=jnp.float32):
    """Heavy-tailed rows whose magnitudes differ by orders, an all-zero block and a zero row."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.t(k1, 3.0, shape) * jnp.exp(jax.random.normal(k2, (shape[0], 1)) * 2)
    return x.at[0, :32].set(0.0).at[5].set(0.0).astype(dtype)


def _with_nonfinite(x):
    """`x` with NaN, +Inf, -Inf and 1e30 in four of its rows (a diverged trainer's input)."""
    return x.at[1, 5].set(jnp.nan).at[2, 70].set(jnp.inf).at[3, 0].set(-jnp.inf).at[4, 33].set(1e30)


def _guide(x, fmt, mode, seed):
    """The kernel's guide tuple and the `fp4.Guidance` of a rollout that saw `x` with 2% noise."""
    noise = jax.random.normal(jax.random.key(seed), x.shape)
    g = fp4.make_guidance(fp4.quantize(x * (1 + 0.02 * noise), fmt), mode)
    global_scale = g.global_scale
    if global_scale is None:
        global_scale = jnp.ones((x.shape[0], 1), jnp.float32)
    return (g.payload, to_bits(g.scales), global_scale), g


def _expected(x, fmt, guidance=None):
    """(packed codes, scale bits, compact bits, global scale) of `trace_jax.fp4`."""
    ref = quantize_capture_reference(x, fmt, guidance=guidance)
    global_scale = ref.global_scale
    if global_scale is None:
        global_scale = jnp.ones((x.shape[0], 1), jnp.float32)
    return ref.packed_codes, to_bits(ref.scales), ref.compact_bits, global_scale


def _assert_same(got, want):
    assert len(got) == len(want) == 4
    for u, v in zip(got, want, strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@functools.cache
def _run(fmt, mode, block_r):
    """The kernel jitted once per (format, mode, block_r), in TPU interpret mode."""
    return jax.jit(
        lambda x, guide: mosaic.quantize_capture_mosaic(
            x, fmt, guide=guide, guide_mode=mode, block_r=block_r, interpret=INTERPRET
        )
    )


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", [None, "compact", "full"])
def test_matches_fp4_quantizer(fmt, mode):
    # Rows 1-4 hold NaN/Inf/1e30, row 5 is zero. Kept under 4096 elements: XLA's CPU max
    # reductions of larger arrays drop NaN (its YNNPACK fusions), in the reference and in
    # interpret mode alike.
    x = _x((8, 256), seed=3)
    guide, g = _guide(x, fmt, mode, seed=9) if mode else (None, None)
    x = _with_nonfinite(x)
    out = _run(fmt, mode, 8)(x, guide)
    _assert_same(out, _expected(x, fmt, g))
    # NaN scales exactly on the blocks (NVFP4: rows) that hold NaN or Inf.
    nan_scale = 0xFF if fmt is fp4.MXFP4 else 0x7F
    bad_rows = np.unique(np.nonzero(np.asarray(out[1]) == nan_scale)[0])
    np.testing.assert_array_equal(bad_rows, [1, 2, 3])
    if mode is not None:  # the guidance was followed, not the trainer's own rounding
        own = _expected(x, fmt)[0]
        assert not np.array_equal(np.asarray(out[0]), np.asarray(own))


@pytest.mark.parametrize(
    ("shape", "block_r", "dtype", "fmt", "mode"),
    [
        ((64, 128), 32, jnp.float32, fp4.NVFP4, None),  # two programs
        ((8, 128), 8, jnp.bfloat16, fp4.MXFP4, "full"),
        ((16, 4096), 16, jnp.float32, fp4.NVFP4, "compact"),  # two column chunks of 2048
    ],
)
def test_shapes_and_dtypes(shape, block_r, dtype, fmt, mode):
    x = _x(shape, seed=shape[1]).astype(dtype)
    guide, g = _guide(x, fmt, mode, seed=4) if mode else (None, None)
    out = _run(fmt, mode, block_r)(x, guide)
    _assert_same(out, _expected(x, fmt, g))
    if dtype == jnp.bfloat16:  # and the Triton kernel's bytes (Pallas interpret mode)
        triton = kernel.quantize_capture_pallas(
            x, fmt, guide=guide, guide_mode=fp4.GuidanceMode(mode), block_r=4, interpret=True
        )
        _assert_same(out, tuple(triton))


def _float32(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


def _ieee_reciprocal(d: np.ndarray) -> np.ndarray:
    """`numerics.reciprocal_rn`'s contract from numpy: IEEE float32 1/d, with zero and subnormal
    d giving +-inf and a subnormal quotient flushed to +-0."""
    with np.errstate(divide="ignore", over="ignore"):
        q = np.float32(1.0) / d
    q = np.where(np.abs(d) < np.float32(2.0**-126), np.copysign(np.inf, d), q)
    return np.where(np.abs(q) < np.float32(2.0**-126), np.copysign(0.0, d), q).astype(np.float32)


def _reciprocal_kernel(d_ref, m_ref, rcp_ref, est_ref):
    rcp_ref[...] = numerics.reciprocal_rn(d_ref[...], estimate=mosaic.reciprocal_estimate)
    est_ref[...] = mosaic.reciprocal_estimate(m_ref[...])


def test_reciprocal_estimate_gives_the_ieee_reciprocal():
    """Inside a TPU-interpreted kernel (whose approximate reciprocal is bfloat16's, about 2**-8):
    the estimate is within two ulp of 1/m, and `reciprocal_rn` with it is IEEE's 1/d."""
    rng = np.random.default_rng(0)
    special = _float32(
        [0x3F800000, 0x3F800001, 0x3FFFFFFF, 0x3FC00000, 0x3FB504F3, 0x3FAAAAAB, 0x3F800800]
    )
    m = np.concatenate([special, rng.uniform(1.0, 2.0, 8 * 512 - special.size)])
    m = m.astype(np.float32).reshape(8, 512)
    edge = np.array(
        [0.0, -0.0, 1e-40, -(2.0**-149), 2.0**-126, 2.0**126, 1.5 * 2.0**126, 2.0**127, 3e38,
         np.inf, -np.inf, np.nan, 1.0, -1.0, 3.0, 0.1],
        np.float32,
    )  # fmt: skip
    bit_patterns = _float32([0x3F800000, 0x3F800001, 0x3FFFFFFF, 0x007FFFFF, 0x00800000])
    random_bits = rng.integers(0x00800000, 0x7F000000, 8 * 512, dtype=np.uint32)
    d = _float32(random_bits) * np.where(rng.random(8 * 512) < 0.5, -1, 1).astype(np.float32)
    d[: edge.size + bit_patterns.size] = np.concatenate([edge, bit_patterns])
    d = d.reshape(8, 512)
    rcp, est = pl.pallas_call(
        _reciprocal_kernel,
        out_shape=[jax.ShapeDtypeStruct(d.shape, jnp.float32)] * 2,
        interpret=INTERPRET,
    )(d, m)
    exact = 1.0 / m.astype(np.float64)
    assert np.max(np.abs(np.asarray(est, np.float64) - exact)) <= 2 * 2.0**-24
    got, want = np.asarray(rcp), _ieee_reciprocal(d)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))


def test_newton_steps_correct_approximations_within_2_pow_minus_8():
    """The hardware approximation may be worse than interpret mode's: any within 2**-8 (here off
    by exactly +-2**-8 or -+2**-9, by mantissa parity) still gives IEEE's reciprocal."""

    def perturbed(m):
        odd = (jax.lax.bitcast_convert_type(m, jnp.int32) & 1) == 1
        off = jnp.where(odd, np.float32(1 + 2.0**-8), np.float32(1 - 2.0**-9))
        return mosaic.newton_reciprocal(m, (np.float32(1.0) / m) * off)

    rng = np.random.default_rng(1)
    m = rng.uniform(1.0, 2.0, 4096).astype(np.float32)
    refined = np.asarray(perturbed(jnp.asarray(m)), np.float64)
    assert np.max(np.abs(refined - 1.0 / m.astype(np.float64))) <= 2 * 2.0**-24
    d = _float32(rng.integers(0x00800000, 0x7F000000, 4096, dtype=np.uint32))
    got = np.asarray(numerics.reciprocal_rn(jnp.asarray(d), estimate=perturbed))
    np.testing.assert_array_equal(got.view(np.uint32), _ieee_reciprocal(d).view(np.uint32))


def test_bad_inputs():
    f = functools.partial(mosaic.quantize_capture_mosaic, block_r=32)
    with pytest.raises(NotImplementedError, match="N=96"):
        f(jnp.ones((32, 96)), fp4.NVFP4)
    with pytest.raises(NotImplementedError, match="N=64"):
        f(jnp.ones((32, 64)), fp4.NVFP4)
    with pytest.raises(ValueError, match="block_r=32 must be a positive divisor of R=48"):
        f(jnp.ones((48, 128)), fp4.NVFP4)
    with pytest.raises(ValueError, match="block_r=8 must be a multiple of 32"):
        mosaic.quantize_capture_mosaic(jnp.ones((16, 128)), fp4.NVFP4, block_r=8)
    with pytest.raises(ValueError, match="packs FP4 codes"):
        f(jnp.ones((32, 128)), fp4.MXFP8)
    with pytest.raises(ValueError, match="floating"):
        f(jnp.ones((32, 128), jnp.int32), fp4.NVFP4)
    guide, _ = _guide(jnp.ones((32, 128)), fp4.NVFP4, "compact", seed=0)
    with pytest.raises(ValueError, match="give both or neither"):
        f(jnp.ones((32, 128)), fp4.NVFP4, guide=guide)
    with pytest.raises(ValueError, match=r"full guide payload must be uint8 \(32, 64\); got uint8"):
        f(jnp.ones((32, 128)), fp4.NVFP4, guide=guide, guide_mode="full")
    with pytest.raises(ValueError, match=r"scale bits must be uint8 \(32, 8\)"):
        f(jnp.ones((32, 128)), fp4.NVFP4, guide=(guide[0], guide[1][:, :4], guide[2]),
          guide_mode="compact")  # fmt: skip
    with pytest.raises(ValueError, match=r"global must be float32 \(32, 1\)"):
        f(jnp.ones((32, 128)), fp4.NVFP4, guide=(*guide[:2], guide[2].T), guide_mode="compact")


@pytest.mark.parametrize("mode", [None, "compact", "full"])
def test_lowers_to_a_tpu_custom_call(mode):
    """The Pallas-to-Mosaic lowering for a TPU, on the CPU (bf16 rows of 8192: several column
    chunks and programs); Mosaic's own layout passes run only in the TPU compiler."""
    r, n = 64, 8192
    for fmt in (fp4.NVFP4, fp4.MXFP4):
        per_byte = {"compact": 8, "full": 2}.get(mode)
        guide = None
        if mode is not None:
            guide = (
                jax.ShapeDtypeStruct((r, n // per_byte), jnp.uint8),
                jax.ShapeDtypeStruct((r, n // fmt.block_size), jnp.uint8),
                jax.ShapeDtypeStruct((r, 1), jnp.float32),
            )

        def quantize(x, guide, fmt=fmt):
            return mosaic.quantize_capture_mosaic(x, fmt, guide=guide, guide_mode=mode, block_r=32)

        x = jax.ShapeDtypeStruct((r, n), jnp.bfloat16)
        lowered = jax.jit(quantize).trace(x, guide).lower(lowering_platforms=("tpu",))
        assert "tpu_custom_call" in lowered.as_text()
