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
