"""Rollout-guided rounding (SPEC 4) and compact guidance (SPEC 5): properties, worked example.

The neighbours `lo <= x / s_rollout <= hi` and the rollout's values come from the independent
float64 reference, so the checks do not reuse the quantizer's own grid arithmetic.
"""

from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fp4 import reference
from trace_jax import fp4

NAMES = ("mxfp4", "nvfp4", "mxfp8")
SHAPE = (4, 64)


@functools.partial(jax.jit, static_argnames=("fmt", "mode"))
def _guided_pair(x_train, x_rollout, fmt, mode):
    """Rollout RTN codes, then the trainer's guided codes from that rollout's guidance."""
    q_roll = fp4.quantize(x_rollout, fmt)
    g = fp4.make_guidance(q_roll, mode)
    q_train = fp4.quantize(x_train, fmt, rounding="guided", guidance=g)
    return q_roll, q_train, fp4.dequantize(q_train)


def _check_guided_properties(x_train, x_rollout, name):
    fmt = fp4.get_format(name)
    roll_ref = reference.ref_quantize(x_rollout, name)
    bs = fmt.block_size
    scale = np.repeat(roll_ref.scale, bs, axis=-1)
    z = reference.f32(x_train.astype(np.float64) * reference.f32(1.0 / scale))
    lo, hi = reference.neighbours(z, name)
    rtn = reference.rtn_values(z, name)
    r = reference.decode_codes(roll_ref.codes, name)
    r_is_neighbour = (r == lo) | (r == hi)

    results = {}
    for mode in ("full", "compact"):
        q_roll, q_train, values = _guided_pair(
            jnp.asarray(x_train), jnp.asarray(x_rollout), fmt, mode
        )
        np.testing.assert_array_equal(np.asarray(q_roll.codes), roll_ref.codes)
        v = reference.decode_codes(np.asarray(q_train.codes), name)
        # Always one of the two neighbours of x / s_rollout.
        assert np.all((v == lo) | (v == hi)), f"{mode}: a value outside {{lo, hi}}"
        # Dequantized with the rollout's scales.
        np.testing.assert_array_equal(
            np.asarray(values, np.float64),
            reference.f32(v * scale) if name == "nvfp4" else v * scale,
        )
        results[mode] = v

    full, compact = results["full"], results["compact"]
    # Full guidance: never farther from r than round-to-nearest; r itself when r is a neighbour.
    assert np.all(np.abs(full - r) <= np.abs(rtn - r))
    np.testing.assert_array_equal(full[r_is_neighbour], r[r_is_neighbour])
    # Compact guidance agrees with full whenever r is a neighbour.
    np.testing.assert_array_equal(compact[r_is_neighbour], full[r_is_neighbour])
    return r_is_neighbour.mean()


# Subnormal inputs are flushed to zero by XLA (documented in trace_jax.fp4.numerics).
_floats = st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False, width=32)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float32, SHAPE, elements=_floats),
    noise=hnp.arrays(np.float32, SHAPE, elements=st.floats(-1, 1, width=32)),
    eps=st.sampled_from([0.0, 1e-4, 1e-3, 1e-2, 1e-1]),
)
def test_guided_properties_hypothesis(name, x, noise, eps):
    x_rollout = (x * (1 + eps * noise)).astype(np.float32)
    # XLA flushes float32 subnormals to zero (documented); the float64 reference does not.
    x_rollout[np.abs(x_rollout) < np.finfo(np.float32).tiny] = 0.0
    _check_guided_properties(x, x_rollout, name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("eps", [1e-3, 1e-2])
def test_guided_properties_random(name, eps):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 256)).astype(np.float32) * 3
    x_rollout = (x * (1 + eps * rng.standard_normal(x.shape))).astype(np.float32)
    neighbour_rate = _check_guided_properties(x, x_rollout, name)
    assert neighbour_rate > 0.99  # small perturbations: the rollout code is nearly always adjacent


def test_worked_example():
    """SPEC 1: 60.24 vs 59.76 with combined scale 24 -> 72 vs 48 under RTN; guided -> 48."""
    x_train = np.zeros((1, 16), np.float32)
    x_train[0, 0] = 144.0  # row and block max: s_g = 144 / 2688, s_b = 448, s_b * s_g = 24
    x_rollout = x_train.copy()
    x_train[0, 1], x_rollout[0, 1] = 60.24, 59.76
    q_train = fp4.quantize(x_train, "nvfp4")
    q_roll = fp4.quantize(x_rollout, "nvfp4")
    combined = fp4.scales_to_float32(q_train.scales, q_train.fmt) * q_train.global_scale
    np.testing.assert_allclose(combined, 24.0, rtol=1e-6)
    np.testing.assert_allclose(fp4.dequantize(q_train)[0, 1], 72.0, rtol=1e-6)
    np.testing.assert_allclose(fp4.dequantize(q_roll)[0, 1], 48.0, rtol=1e-6)
    for mode in ("full", "compact"):
        _, q_guided, values = _guided_pair(x_train, x_rollout, fp4.NVFP4, mode)
        assert q_guided.codes[0, 1] == q_roll.codes[0, 1]
        np.testing.assert_allclose(values[0, 1], 48.0, rtol=1e-6)


def test_mask_rows_fall_back_to_own_rtn():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    x_roll = x * 1.3  # different scales and codes
    mask = np.array([True, False, True, False, False, True])
    for name in NAMES:
        q_roll = fp4.quantize(x_roll, name)
        g = fp4.make_guidance(q_roll, "compact", mask=jnp.asarray(mask))
        q = jax.jit(lambda x, g, name=name: fp4.quantize(x, name, rounding="guided", guidance=g))(
            x, g
        )
        own = fp4.quantize(x, name)
        unguided = fp4.quantize(x, name, rounding="guided", guidance=fp4.make_guidance(q_roll))
        np.testing.assert_array_equal(np.asarray(q.codes)[~mask], np.asarray(own.codes)[~mask])
        np.testing.assert_array_equal(np.asarray(q.codes)[mask], np.asarray(unguided.codes)[mask])


@pytest.mark.parametrize("name", NAMES)
def test_stochastic_rounding_is_unbiased_and_on_neighbours(name):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 4000)
    f = jax.jit(
        jax.vmap(lambda k: fp4.dequantize(fp4.quantize(x, name, rounding="stochastic", key=k)))
    )
    samples = np.asarray(f(keys), np.float64)[:, 0]
    ref = reference.ref_quantize(x, name)
    scale = np.repeat(ref.scale, fp4.get_format(name).block_size, axis=-1)[0]
    lo, hi = reference.neighbours(ref.z[0], name)
    lo_v, hi_v = reference.f32(lo * scale), reference.f32(hi * scale)
    assert np.all((samples == lo_v) | (samples == hi_v))
    zc = np.clip(ref.z[0], lo, hi)  # saturated values are clipped, not unbiased
    expected = zc * scale
    stderr = (hi - lo) * scale / 2 / np.sqrt(len(keys))
    assert np.all(np.abs(samples.mean(0) - expected) <= 5 * stderr + 1e-6 * np.abs(expected))


def test_guidance_bits_per_element_and_bytes():
    assert fp4.guidance_bits_per_element(fp4.MXFP4, "full") == 4.25
    assert fp4.guidance_bits_per_element(fp4.MXFP4, "compact") == 1.25
    assert fp4.guidance_bits_per_element(fp4.NVFP4, "full") == 4.5
    assert fp4.guidance_bits_per_element(fp4.NVFP4, "compact") == 1.5
    assert fp4.guidance_bits_per_element(fp4.NVFP4, "compact", row_length=128) == 1.75
    assert fp4.guidance_bits_per_element(fp4.MXFP8, "full") == 8.25
    q = fp4.quantize(np.ones((4, 64), np.float32), "mxfp4")
    assert fp4.make_guidance(q, "full").nbytes == 4 * 64 // 2 + 4 * 2
    assert fp4.make_guidance(q, "compact").nbytes == 4 * 64 // 8 + 4 * 2


def test_full_guidance_as_compact_equals_compact_capture():
    x = jax.random.normal(jax.random.key(11), (4, 64))
    for fmt in ("nvfp4", "mxfp4"):
        q = fp4.quantize(x, fmt)
        full, compact = fp4.make_guidance(q, "full"), fp4.make_guidance(q, "compact")
        got = full.as_compact()
        assert got.mode is fp4.GuidanceMode.COMPACT and compact.as_compact() is compact
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(compact), strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _with_nonfinite(x: np.ndarray, seed: int) -> np.ndarray:
    """`x` with NaN, +Inf, -Inf and 1e30 at random positions (two rows left clean)."""
    rng = np.random.default_rng(seed)
    x = x.copy()
    rows = rng.permutation(x.shape[0])[2:]
    for i, value in enumerate([np.nan, np.inf, -np.inf, 1e30, np.nan, -1e30]):
        x[rows[i % len(rows)], rng.integers(x.shape[1])] = value
    return x


@functools.partial(jax.jit, static_argnames=("fmt", "entry"))
def _guided_values(x, g, fmt, entry):
    """Dequantized guided rounding of `x` by `entry`: "quantize" (with its QTensor) or
    "fake_quant" (with its straight-through gradient of sum(values))."""
    if entry == "quantize":
        q = fp4.quantize(x, fmt, rounding="guided", guidance=g)
        return fp4.dequantize(q), q
    values, vjp = jax.vjp(lambda t: fp4.fake_quant(t, fmt, rounding="guided", guidance=g), x)
    return values, vjp(jnp.ones_like(x))[0]


@pytest.mark.parametrize("entry", ["quantize", "fake_quant"])
@pytest.mark.parametrize("mode", ["full", "compact"])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_guided_rounding_keeps_the_nan_policy_of_rtn(name, mode, entry):
    """A block (NVFP4: a row) holding NaN or Inf dequantizes to NaN under guided rounding exactly
    where RTN's does; 1e30 is finite for both. The other blocks are guided as if clean."""
    fmt = fp4.get_format(name)
    rng = np.random.default_rng(21)
    x_clean = (rng.standard_normal((8, 64)) * 2).astype(np.float32)
    x = _with_nonfinite(x_clean, seed=len(name) + len(mode))
    mask = jnp.asarray(np.arange(8) != 5)  # a row without guidance: the trainer's own RTN
    g = fp4.make_guidance(fp4.quantize(x_clean * 1.01, fmt), mode, mask=mask)

    rtn = fp4.quantize(x, fmt)
    rtn_nan = np.isnan(np.asarray(fp4.dequantize(rtn)))
    assert rtn_nan.any() and not rtn_nan.all()
    values, aux = _guided_values(jnp.asarray(x), g, fmt, entry)
    values = np.asarray(values)
    np.testing.assert_array_equal(np.isnan(values), rtn_nan)
    # Unmarked blocks: the guided values of the same input with its NaN and Inf zeroed.
    clean_values, _ = _guided_values(jnp.asarray(np.where(np.isfinite(x), x, 0)), g, fmt, entry)
    np.testing.assert_array_equal(values[~rtn_nan], np.asarray(clean_values)[~rtn_nan])
    if entry == "quantize":  # the same NaN scales (and NVFP4 global scales) and codes as RTN's
        marked = np.isnan(np.asarray(fp4.scales_to_float32(rtn.scales, fmt)))
        got = np.asarray(fp4.scales_to_float32(aux.scales, fmt))
        np.testing.assert_array_equal(np.isnan(got), marked)
        rows = np.any(marked, axis=-1)
        codes, rtn_codes = np.asarray(aux.codes), np.asarray(rtn.codes)
        np.testing.assert_array_equal(codes[rtn_nan], rtn_codes[rtn_nan])
        if fmt.has_global_scale:
            np.testing.assert_array_equal(np.isnan(np.asarray(aux.global_scale))[:, 0], rows)
    else:  # straight-through: the identity, NaN blocks or not
        np.testing.assert_array_equal(np.asarray(aux), np.ones_like(x))
