"""Round-to-nearest quantization, bit-exact against the float64 + ml_dtypes reference.

Everything runs under `jax.jit`, on whatever backend JAX picked: this module is also run on the
H200 (see experiments/results/fp4_tests_h200.md) to prove the GPU path really quantizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.fp4 import cases, reference
from trace_jax import fp4
from trace_jax.fp4 import numerics, scales
from trace_jax.fp4.quantize import quantize_core

NAMES = ("mxfp4", "nvfp4", "mxfp8")


@functools.partial(jax.jit, static_argnames="fmt")
def _quantize_dequantize(x, fmt):
    q = fp4.quantize(x, fmt)
    return q, fp4.dequantize(q), fp4.scales_to_float32(q.scales, q.fmt)


def _assert_matches_reference(x: np.ndarray, name: str) -> None:
    q, values, _ = _quantize_dequantize(jnp.asarray(x), fp4.get_format(name))
    ref = reference.ref_quantize(x, name)
    codes = np.asarray(q.codes)
    bad = np.argwhere(codes != ref.codes)
    assert bad.size == 0, (
        f"{name}: {len(bad)} code mismatches, first at {bad[0]}: x={x[tuple(bad[0])]!r} "
        f"got {codes[tuple(bad[0])]} want {ref.codes[tuple(bad[0])]}"
    )
    np.testing.assert_array_equal(np.asarray(values, np.float64), ref.values)
    # Scale bits: E8M0 exponent, or the E4M3 pattern of the block scale.
    bits = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8))
    if name.startswith("mx"):
        _, ex = np.frexp(ref.block_scale)
        np.testing.assert_array_equal(bits.astype(int), ex - 1 + 127)
    else:
        want = ref.block_scale.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        np.testing.assert_array_equal(bits, want)
        np.testing.assert_array_equal(np.asarray(q.global_scale, np.float64), ref.global_scale)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rtn_bit_exact_on_random_data(name, seed):
    for label, x in cases.random_cases(seed).items():
        try:
            _assert_matches_reference(x, name)
        except AssertionError as e:
            raise AssertionError(f"case {label}: {e}") from None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rtn_bit_exact_on_ties_saturation_and_zero_blocks(name, seed):
    x = cases.edge_cases(name, seed)
    cov = cases.coverage(x, name)
    # The cases must really exercise what they claim to.
    assert cov["ties"] > 200 and cov["saturated"] > 5 and cov["zero_blocks"] >= 2, cov
    _assert_matches_reference(x, name)


def test_e2m1_ties_go_to_even():
    x = np.zeros((1, 32), np.float32)
    x[0, :8] = [4.0, 2.5, 5.0, 0.25, 0.75, 1.25, 1.75, 3.5]  # block max 4: X = 1
    x[0, 8:16] = -x[0, :8]
    q, values, _ = _quantize_dequantize(jnp.asarray(x), fp4.MXFP4)
    want = [4.0, 2.0, 4.0, 0.0, 1.0, 1.0, 2.0, 4.0]
    np.testing.assert_array_equal(np.asarray(values)[0, :8], want)
    np.testing.assert_array_equal(np.asarray(values)[0, 8:16], -np.asarray(want))
    assert np.asarray(q.codes)[0, 11] == 0  # -0.25 rounds to zero, encoded as +0


def test_zero_block_has_codes_zero_and_smallest_scale():
    x = np.zeros((2, 32), np.float32)
    x[1, 16:] = 1.0
    for fmt in (fp4.MXFP4, fp4.NVFP4):
        q, values, _ = _quantize_dequantize(jnp.asarray(x), fmt)
        assert not np.asarray(q.codes)[0].any()
        bits = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8))
        smallest = 0 if fmt is fp4.MXFP4 else 1  # E8M0 2**-127; E4M3 2**-9
        assert (bits[0] == smallest).all(), bits
        assert not np.asarray(values)[0].any()


def test_quantization_is_not_folded_under_jit():
    """The astype trap: a cast-based fake quantizer becomes a copy under jit on GPU."""
    x = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32)
    for fmt in (fp4.MXFP4, fp4.NVFP4):
        f = jax.jit(lambda x, fmt=fmt: fp4.fake_quant(x, fmt))
        y = np.asarray(f(x))
        assert np.mean(y != np.asarray(x)) > 0.9
        assert len(np.unique(np.abs(y[0, :16]) / np.abs(y[0, :16]).max())) <= 8
        hlo = f.lower(x).compile().as_text()
        assert "f4e2m1fn" not in hlo.lower()


def test_dequantize_dtype_and_bf16_input():
    x = jax.random.normal(jax.random.key(1), (8, 64), jnp.bfloat16)
    q = jax.jit(lambda x: fp4.quantize(x, "mxfp4"))(x)
    assert fp4.dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16
    ref = reference.ref_quantize(np.asarray(x, np.float32), "mxfp4")
    np.testing.assert_array_equal(np.asarray(q.codes), ref.codes)


# 3 x 2048 reaches 4096 elements, from where XLA's CPU float max reduction drops NaN.
@pytest.mark.parametrize("cols", [64, 2048])
@pytest.mark.parametrize("name", NAMES)
def test_nan_and_inf_make_their_block_nan(name, cols):
    fmt = fp4.get_format(name)
    x = np.random.default_rng(0).standard_normal((3, cols)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    _, values, _ = _quantize_dequantize(jnp.asarray(x), fmt)
    values = np.asarray(values)
    bs = fmt.block_size
    assert np.isnan(values[0, :bs]).all() and np.isnan(values[1, :bs]).all()
    assert np.isfinite(values[2]).all()
    if fmt.has_global_scale:  # the row's global scale is NaN too: the whole row is NaN
        assert np.isnan(values[:2]).all()
    else:
        assert np.isfinite(values[:2, bs:]).all()


def test_global_axes():
    x = jax.random.normal(jax.random.key(2), (4, 8, 32)) * jnp.arange(1, 5)[:, None, None]
    per_row = fp4.quantize(x, "nvfp4")
    per_tensor = fp4.quantize(x, "nvfp4", global_axes=None)
    per_matrix = fp4.quantize(x, "nvfp4", global_axes=(1, 2))
    assert per_row.global_scale.shape == (4, 8, 1)
    assert per_tensor.global_scale.shape == (1, 1, 1)
    assert per_matrix.global_scale.shape == (4, 1, 1)
    np.testing.assert_allclose(per_tensor.global_scale.ravel(), jnp.abs(x).max() / 2688, rtol=1e-6)
    with pytest.raises(ValueError, match="must include the last axis"):
        fp4.quantize(x, "nvfp4", global_axes=(0,))


def test_formats():
    assert fp4.get_format("MXFP4") is fp4.MXFP4
    assert (fp4.MXFP4.block_size, fp4.NVFP4.block_size, fp4.MXFP8.block_size) == (32, 16, 32)
    assert fp4.NVFP4.has_global_scale and not fp4.MXFP4.has_global_scale
    assert fp4.MXFP4.scale_dtype == jnp.float8_e8m0fnu
    assert fp4.NVFP4.scale_dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(fp4.ElementType.E2M1.spec.grid(), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(fp4.ElementType.E4M3.spec.grid(), reference.grid("mxfp8"))
    with pytest.raises(ValueError, match="unknown block format"):
        fp4.get_format("fp3")


@pytest.mark.parametrize("name", ("nvfp4", "mxfp8"))
def test_nearest_even_index_matches_the_grid_rule_and_ml_dtypes(name):
    """The fast RTN code (2**23 rounding trick) against ml_dtypes' cast and the two-neighbour rule,
    on every grid point, every midpoint and its float32 neighbours, and random magnitudes over
    all binades down to float32's smallest normals."""
    spec = fp4.get_format(name).elem
    g = reference.grid(name)
    mids = (g[1:] + g[:-1]) / 2
    near = np.concatenate([g, mids]).astype(np.float32)
    near = np.concatenate([near, np.nextafter(near, 0), np.nextafter(near, np.inf)])
    rng = np.random.default_rng(0)
    rand = np.exp2(rng.uniform(-126, np.log2(spec.max_value), 20_000)).astype(np.float32)
    a = np.clip(np.concatenate([near, rand, [0.0, 1e-38]]), 0, spec.max_value).astype(np.float32)

    got = np.asarray(jax.jit(numerics.nearest_even_index, static_argnums=1)(a, spec))
    want, _ = reference.element_codes(a, name)
    np.testing.assert_array_equal(got, want.astype(np.int32))
    lo, hi, lo_idx, hi_idx = numerics.grid_neighbours(jnp.asarray(a), spec)
    two_neighbours = numerics.select_nearest_even(jnp.asarray(a), lo, hi, lo_idx, hi_idx)
    np.testing.assert_array_equal(got, np.asarray(two_neighbours))


def test_decode_e4m3_bits_matches_ml_dtypes_on_all_256_patterns():
    bits = np.arange(256, dtype=np.uint8)
    want = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(jax.jit(numerics.decode_e4m3_bits)(bits))
    np.testing.assert_array_equal(got, want)  # NaN positions equal too
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 for 0x80
    generic = numerics.decode(jnp.asarray(bits), fp4.ElementType.E4M3.spec)
    np.testing.assert_array_equal(got, np.asarray(generic))


def _estimate_off_by(d: np.ndarray, ulps: int):
    """An estimate of `1 / m` (m the mantissa of each `d` in [1, 2)) `ulps` float32 steps from
    numpy's IEEE one, the same on every platform (the GPU's own `div.full.f32`, within one ulp
    here, would add its error to the perturbation)."""
    m = (d.view(np.int32) & 0x7FFFFF | 0x3F800000).view(np.float32)
    r = np.float32(1.0) / m
    for _ in range(abs(ulps)):
        r = np.nextafter(r, np.float32(np.inf if ulps > 0 else 0.0))
    return lambda m_traced: jnp.asarray(r)


@pytest.mark.parametrize("ulps", (None, 0, 1, -1, 2, -2))
def test_reciprocal_rn_is_ieee_from_an_estimate_off_by_up_to_two_ulp(ulps):
    """`numerics.reciprocal_rn` against numpy's IEEE float32 1 / d, bit for bit, whatever the
    estimate's last bits (None: the platform's own path, a plain division on the CPU): random d
    over the whole normal range, both signs, powers of two and the mantissas next to them, and
    the special values with their fixed results (a subnormal quotient flushed to +-0, a subnormal
    d giving +-inf)."""
    rng = np.random.default_rng((ulps or 0) + 3)
    mant = rng.uniform(1, 2, 50_000) * rng.choice([-1, 1], 50_000)
    rand = mant * np.exp2(rng.integers(-126, 126, 50_000))
    pow2 = np.exp2(np.arange(-126, 127.0))
    edges = np.concatenate([pow2, pow2 * (1 + 2.0**-23), pow2 * (2 - 2.0**-23)])
    special = [0.0, np.inf, np.nan, 1e-40, 1.1e-38, np.finfo(np.float32).max, 2.0**126 * 1.5]
    d = np.concatenate([rand, edges, -edges, special, np.negative(special)]).astype(np.float32)
    estimate = None if ulps is None else _estimate_off_by(d, ulps)
    got = np.asarray(jax.jit(lambda x: numerics.reciprocal_rn(x, estimate=estimate))(d))
    tiny = np.finfo(np.float32).tiny
    with np.errstate(divide="ignore", over="ignore"):
        want = np.where(np.abs(d) < tiny, np.copysign(np.float32(np.inf), d), np.float32(1.0) / d)
    want = np.where(np.abs(want) < tiny, np.copysign(np.float32(0.0), want), want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("ulps", (2, -2))
def test_quantize_core_uses_the_given_estimate_and_keeps_its_bits(ulps):
    """The quantize kernel's reciprocal estimate reaches both reciprocals of NVFP4 quantization
    (the per-row 1 / (6 s_g) and the per-block 1 / (s_b s_g)) and changes no bit."""
    x = jax.random.normal(jax.random.key(ulps + 10), (8, 256), jnp.float32) * 3.0
    s_g = scales.global_scale(x, fp4.NVFP4, (-1,))
    calls = []

    def estimate(m):
        calls.append(m.shape)
        r = jnp.float32(1.0) / m
        for _ in range(abs(ulps)):
            r = jnp.nextafter(r, jnp.float32(np.inf if ulps > 0 else 0.0))
        return r

    core = functools.partial(quantize_core, fmt=fp4.NVFP4, s_g=s_g)
    got = jax.jit(lambda a: core(a, reciprocal_estimate=estimate))(x)
    want = jax.jit(core)(x)
    assert sorted(calls) == [(8, 1), (8, 16)]  # per row, per block
    for u, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("shape", [(7,), (3, 4096), (2, 3, 2048)])
def test_abs_max_equals_numpy_and_keeps_nan(shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 1e3).astype(np.float32)
    x.reshape(-1)[rng.integers(x.size)] = -np.inf
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda a: numerics.abs_max(a, -1))(x)), np.abs(x).max(-1)
    )
    x.reshape(-1)[-1] = -np.nan  # a NaN with its sign bit set, in the last row
    got = np.asarray(jax.jit(lambda a: numerics.abs_max(a, None, keepdims=True))(x))
    assert got.shape == (1,) * x.ndim and np.isnan(got).all()
    rows = np.asarray(jax.jit(lambda a: numerics.abs_max(a, -1))(x)).reshape(-1)
    assert np.isnan(rows[-1]) and not np.isnan(rows[:-1]).any()
