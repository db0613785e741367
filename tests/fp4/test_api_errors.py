"""Packing round trips and the clear errors on bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trace_jax import fp4


@settings(max_examples=30, deadline=None)
@given(
    codes=hnp.arrays(
        np.uint8,
        st.tuples(st.integers(1, 3), st.sampled_from([2, 8, 64])),
        elements=st.integers(0, 15),
    )
)
def test_pack_fp4_round_trip(codes):
    packed = fp4.pack_fp4(codes)
    assert packed.shape == (*codes.shape[:-1], codes.shape[-1] // 2)
    np.testing.assert_array_equal(packed & 0xF, codes[..., 0::2])  # element 2i: low nibble
    np.testing.assert_array_equal(packed >> 4, codes[..., 1::2])
    np.testing.assert_array_equal(fp4.unpack_fp4(packed), codes)


@settings(max_examples=30, deadline=None)
@given(
    bits=hnp.arrays(
        np.uint8, st.tuples(st.integers(1, 3), st.sampled_from([8, 64])), elements=st.integers(0, 1)
    )
)
def test_pack_bits_round_trip(bits):
    packed = np.asarray(fp4.pack_bits(bits))
    assert packed.shape == (*bits.shape[:-1], bits.shape[-1] // 8)
    np.testing.assert_array_equal(np.unpackbits(packed, axis=-1, bitorder="little"), bits)
    np.testing.assert_array_equal(fp4.unpack_bits(packed), bits)


def test_guidance_carries_codes_and_bits():
    x = jax.random.normal(jax.random.key(0), (4, 64))
    q = fp4.quantize(x, "nvfp4")
    full = fp4.make_guidance(q, "full")
    compact = fp4.make_guidance(q, "compact")
    np.testing.assert_array_equal(full.rollout_codes(), q.codes)
    np.testing.assert_array_equal(compact.mantissa_bits(), q.codes & 1)
    np.testing.assert_array_equal(full.mantissa_bits(), q.codes & 1)
    assert full.shape == compact.shape == (4, 64)
    with pytest.raises(ValueError, match="needs full guidance"):
        compact.rollout_codes()
    q.validate()


def test_errors_are_clear():
    x = jnp.ones((4, 48))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        fp4.quantize(x, "mxfp4")
    with pytest.raises(ValueError, match="unknown block format"):
        fp4.quantize(jnp.ones((4, 64)), "int4")
    with pytest.raises(TypeError, match="floating-point"):
        fp4.quantize(jnp.ones((4, 64), jnp.int32), "mxfp4")
    with pytest.raises(ValueError, match="cannot quantize a scalar"):
        fp4.quantize(jnp.float32(1.0), "mxfp4")
    x = jnp.ones((4, 64))
    with pytest.raises(ValueError, match="needs a PRNG"):
        fp4.quantize(x, "mxfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="needs the rollout's"):
        fp4.quantize(x, "mxfp4", rounding="guided")
    with pytest.raises(ValueError, match="only used by rounding='guided'"):
        fp4.quantize(x, "mxfp4", guidance=fp4.make_guidance(fp4.quantize(x, "mxfp4")))
    with pytest.raises(ValueError, match="only used by rounding='stochastic'"):
        fp4.quantize(x, "mxfp4", key=jax.random.key(0))
    with pytest.raises(ValueError, match="'nearest' is not a valid Rounding"):
        fp4.quantize(x, "mxfp4", rounding="nearest")
    g_mx = fp4.make_guidance(fp4.quantize(x, "mxfp4"))
    with pytest.raises(ValueError, match="guidance is mxfp4 but the tensor is quantized as nvfp4"):
        fp4.quantize(x, "nvfp4", rounding="guided", guidance=g_mx)
    with pytest.raises(ValueError, match="cannot guide a tensor of shape"):
        fp4.quantize(jnp.ones((2, 64)), "mxfp4", rounding="guided", guidance=g_mx)
    with pytest.raises(ValueError, match="mask of shape"):
        fp4.make_guidance(fp4.quantize(x, "mxfp4"), mask=jnp.ones((3,), bool))
    with pytest.raises(ValueError, match="not a valid GuidanceMode"):
        fp4.make_guidance(fp4.quantize(x, "mxfp4"), "half")
    with pytest.raises(ValueError, match="multiple of 2"):
        fp4.pack_fp4(jnp.ones((3,), jnp.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        fp4.pack_bits(jnp.ones((12,), jnp.uint8))
    bad = fp4.QTensor(jnp.zeros((4, 64), jnp.uint8), jnp.zeros((4, 3), jnp.uint8), None, fp4.MXFP4)
    with pytest.raises(ValueError, match="do not match"):
        bad.validate()


def test_to_compact_equals_compact_from_qtensor():
    x = jax.random.normal(jax.random.key(3), (2, 3, 64))
    q = fp4.quantize(x, "nvfp4")
    a = fp4.to_compact(fp4.make_guidance(q, "full"))
    b = fp4.make_guidance(q, "compact")
    assert a.mode == b.mode == fp4.GuidanceMode.COMPACT
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)
    assert fp4.to_compact(b) is b
