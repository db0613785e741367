"""The kernels' shared pieces: the FP8- and float16-aligned FP4 decodes equal the quantizer's
for every byte, split block scales multiply back, and the choice of where and how a kernel runs
(`implementation_order`, `pallas_target`, `lowering_for`, `interpreting`)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

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


def test_implementation_order():
    """None: Pallas then XLA where Pallas compiles (a GPU, a TPU), XLA alone elsewhere; a name
    alone; a sequence in order."""
    impl = common.Implementation
    with common.lowering_for("cpu"):
        assert common.implementation_order(None) == (impl.XLA,)
        with common.interpreting(True):  # interpretation is asked for by name, never by default
            assert common.implementation_order(None) == (impl.XLA,)
    for platform in ("gpu", "cuda", "tpu"):
        with common.lowering_for(platform):
            assert common.implementation_order(None) == (impl.PALLAS, impl.XLA)
    assert common.implementation_order("pallas") == (impl.PALLAS,)
    assert common.implementation_order(["xla", impl.PALLAS]) == (impl.XLA, impl.PALLAS)
    with pytest.raises(ValueError, match="got 'auto'"):
        common.implementation_order("auto")
    with pytest.raises(ValueError, match="empty"):
        common.implementation_order([])


def test_pallas_target_is_native_or_explicitly_interpreted():
    """Native: Triton on a GPU, Mosaic on a TPU, an error naming the platform and the ways to
    interpret elsewhere; True: Triton interpreted; InterpretParams: Mosaic interpreted; the
    `interpreting` context stands in for a call's None, never for its explicit value."""
    triton, mosaic = common.Lowering.TRITON, common.Lowering.MOSAIC
    params = pltpu.InterpretParams(uninitialized_memory="zero")
    target = common.pallas_target
    with common.lowering_for("cpu"):
        assert common.kernel_platform() == "cpu" and common.native_lowering() is None
        for interpret in (None, False):
            with pytest.raises(common.PallasUnavailableError) as e:
                target(interpret)
            assert isinstance(e.value, NotImplementedError)  # orders fall through it
            for words in ("platform 'cpu'", "interpret=True", "InterpretParams", "interpreting"):
                assert words in str(e.value)
        assert target(True) == common.PallasTarget(triton, True) and target(True).interpreted
        assert target(params) == common.PallasTarget(mosaic, params) and target(params).interpreted
        with common.interpreting(True):
            assert target(None) == common.PallasTarget(triton, True)
            assert target(params).lowering is mosaic  # the call's own value wins
            with pytest.raises(common.PallasUnavailableError):
                target(False)
            with common.interpreting(params):
                assert target(None) == common.PallasTarget(mosaic, params)
            assert target(None).lowering is triton  # the inner context is undone
        with pytest.raises(common.PallasUnavailableError):
            target(None)
        with common.lowering_for("gpu"):
            assert common.on_gpu() and target(None) == common.PallasTarget(triton, False)
            assert not target(None).interpreted
        with common.lowering_for("tpu"):
            assert target(None) == common.PallasTarget(mosaic, None)
            assert target(True) == common.PallasTarget(triton, True)
        assert common.kernel_platform() == "cpu"
    with pytest.raises(ValueError, match="got 'rocm'"):
        with common.lowering_for("rocm"):
            pass
    with pytest.raises(ValueError, match="interpret must be None, a bool or"):
        target("yes")
    with pytest.raises(ValueError, match="got 1"):
        with common.interpreting(1):
            pass


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
