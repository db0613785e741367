"""The kernels' FP8-aligned FP4 decode equals the quantizer's decode times 2**-6, every byte."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import common
from trace_jax.fp4 import ElementType, numerics


def test_planes_equal_quantizer_decode_for_all_bytes():
    packed = np.arange(256, dtype=np.uint8)
    low, high = common.fp4_planes_as_e4m3(packed)
    e2m1 = np.asarray(numerics.decode(np.arange(16, dtype=np.uint8), ElementType.E2M1.spec))
    # ml_dtypes' float4_e2m1fn is an independent table of the same 16 values.
    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(e2m1, table)
    for plane, nibble in ((low, packed & 0xF), (high, packed >> 4)):
        got = np.asarray(plane).astype(np.float64)
        np.testing.assert_array_equal(got, table[nibble] * common.E4M3_ALIGN)
        np.testing.assert_array_equal(np.signbit(got), nibble >= 8)  # -0.0 kept


def test_unpacked_codes_and_bad_dtype():
    codes = np.arange(16, dtype=np.uint8)
    got = np.asarray(common.e2m1_codes_as_e4m3(codes)).astype(np.float64)
    table = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(got, table * common.E4M3_ALIGN)
    with pytest.raises(ValueError, match="uint8"):
        common.fp4_planes_as_e4m3(np.zeros(4, np.int32))


def test_f16_planes_equal_quantizer_decode_for_all_bytes():
    packed = np.arange(256, dtype=np.uint8)
    low, high = common.fp4_planes_as_f16(packed)
    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    for plane, nibble in ((low, packed & 0xF), (high, packed >> 4)):
        assert plane.dtype == np.float16
        got = np.asarray(plane).astype(np.float64)
        np.testing.assert_array_equal(got, table[nibble] * common.F16_ALIGN)
        np.testing.assert_array_equal(np.signbit(got), nibble >= 8)
    with pytest.raises(ValueError, match="uint8"):
        common.fp4_planes_as_f16(np.zeros(4, np.int32))


@pytest.mark.parametrize("fmt_name", ["NVFP4", "MXFP4"])
def test_split_block_scales_multiply_back_to_the_block_scale(fmt_name):
    from trace_jax import fp4

    fmt = getattr(fp4, fmt_name)
    rng = np.random.default_rng(0)
    rows, nb = 64, 8
    if fmt.scale.name == "E4M3":
        bits = rng.integers(0, 0x7F, (rows, nb)).astype(np.uint8)  # finite positive E4M3
        full = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        glob = rng.uniform(0.1, 10.0, rows).astype(np.float32)
        elem, row = common.split_block_scales(bits, fmt, glob)
        want = full * glob[:, None].astype(np.float64)
    else:
        # Exponents within 24 of the row max: exact; one row spans far more (flushes).
        bits = (rng.integers(100, 125, (rows, nb)) + rng.integers(0, 10, (rows, 1))).astype(
            np.uint8
        )
        bits[0, 0] = 250
        full = np.exp2(bits.astype(np.float64) - 127)
        elem, row = common.split_block_scales(bits, fmt)
        want = full
    elem = np.asarray(elem)
    assert elem.dtype == np.float16 and np.asarray(row).dtype == np.float32
    got = elem.astype(np.float64) * np.asarray(row, np.float64)[:, None]
    if fmt.scale.name == "E8M0":
        # Row 0's max is 2**123; its other blocks are > 2**24 smaller and flush to zero.
        np.testing.assert_array_equal(got[0, 1:], 0.0)
        np.testing.assert_array_equal(got[0, 0], want[0, 0])
        got, want = got[1:], want[1:]
    np.testing.assert_array_equal(got, want)


def test_implementation_order(monkeypatch):
    """None: Pallas then XLA on a GPU, XLA alone elsewhere; a name alone; a sequence in order."""
    impl = common.Implementation
    monkeypatch.setattr(common, "on_gpu", lambda: False)
    assert common.implementation_order(None) == (impl.XLA,)
    assert common.interpret_mode(None) and not common.interpret_mode(False)
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    assert common.implementation_order(None) == (impl.PALLAS, impl.XLA)
    assert not common.interpret_mode(None)
    assert common.implementation_order("pallas") == (impl.PALLAS,)
    assert common.implementation_order(["xla", impl.PALLAS]) == (impl.XLA, impl.PALLAS)
    with pytest.raises(ValueError, match="got 'auto'"):
        common.implementation_order("auto")
    with pytest.raises(ValueError, match="empty"):
        common.implementation_order([])


def test_run_first_falls_back_on_not_implemented_only():
    def refuse():
        raise NotImplementedError("no kernel for this shape")

    def fail():
        raise ValueError("bad argument")

    assert common.run_first(["a", "b"], {"a": refuse, "b": lambda: 7}) == (7, "b")
    assert common.run_first(["b", "a"], {"a": refuse, "b": lambda: 7}) == (7, "b")
    with pytest.raises(NotImplementedError, match="no kernel"):
        common.run_first(["a"], {"a": refuse})
    with pytest.raises(ValueError, match="bad argument"):  # only NotImplementedError moves on
        common.run_first(["a", "b"], {"a": fail, "b": lambda: 7})
