"""The Mosaic (TPU) FP4 MoE grouped matmul, in TPU interpret mode, against the float32 reference.

Operands and tolerance are the op's shared ones (`test_fp4_moe_matmul`: random normal values,
|out - ref| <= 1e-5 * (|a| @ |w|^T) per element, the float32 summation-order bound; the kernel's
bfloat16 operands are exact). Shapes are Mosaic-sized but tiny: G = 4 experts, K = 256 (512 for
several K steps), N = 256 (two N tiles of 128), M = 200 rows in row tiles of 64, with empty groups,
tiles straddling group boundaries, and sum(group_sizes) < M. Interpret mode starts scratch memory
as NaN, so a visit that reads an accumulator or scale scratch it never wrote fails here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.fp4_moe_matmul import PackedFP4Weights
from kernels_pallas.fp4_moe_matmul.mosaic import fp4_moe_matmul_mosaic
from tests.kernels_pallas.test_fp4_moe_matmul import (
    RTOL_OF_MAGNITUDE,
    assert_matches_reference,
    make_operands,
    reference_and_magnitude,
)
from trace_jax import fp4

M, K, N = 200, 256, 256
TILES = dict(block_m=64, block_n=128, block_k=256)
GROUP_SIZES = {
    "empty_one_ragged": (0, 1, 130, 33),  # sum 164 < M: a tile holds three groups and the tail
    "last_group_to_m": (17, 0, 0, 183),  # sum = M: the tail is only the padding to 256 rows
}
# (weights, activations); None: bfloat16 activations.
FORMATS = [
    (fp4.NVFP4, None),
    (fp4.MXFP4, fp4.MXFP8),
    (fp4.NVFP4, fp4.NVFP4),
    (fp4.MXFP4, fp4.NVFP4),
]


def _id(fmt) -> str:
    return "bf16" if fmt is None else fmt.name


def mosaic(lhs, rhs, group_sizes, **kwargs):
    return fp4_moe_matmul_mosaic(
        lhs, rhs, group_sizes, interpret=pltpu.InterpretParams(), **(TILES | kwargs)
    )


@pytest.mark.parametrize(("w_fmt", "a_fmt"), FORMATS, ids=lambda f: _id(f))
def test_matches_reference(w_fmt, a_fmt):
    lhs, rhs = make_operands(w_fmt, a_fmt, m=M, k=K, n=N)
    for sizes in GROUP_SIZES.values():
        gs = jnp.asarray(sizes, jnp.int32)
        out = mosaic(lhs, rhs, gs, out_dtype=jnp.float32)
        assert_matches_reference(out, lhs, rhs, gs, exact=False)


def test_k_steps_and_no_tail():
    """K = 512 in two K steps (scale blocks spread at a K offset, accumulation across grid steps);
    groups fill M = 128 exactly, so no visit is the tail's; row tiles of 32, one N tile of 256."""
    lhs, rhs = make_operands(fp4.NVFP4, fp4.NVFP4, m=128, k=512, n=N, seed=2)
    gs = jnp.asarray((30, 0, 98, 0), jnp.int32)
    out = mosaic(lhs, rhs, gs, block_m=32, block_n=256, out_dtype=jnp.float32)
    assert_matches_reference(out, lhs, rhs, gs, exact=False)


def test_fewer_rows_than_a_tile_and_no_groups():
    """M = 10 with the default block_m = 128 (lowered to 16 rows); then every group empty."""
    lhs, rhs = make_operands(fp4.MXFP4, None, m=10, k=K, n=N, seed=3)
    for sizes in ((3, 0, 2, 4), (0, 0, 0, 0)):
        gs = jnp.asarray(sizes, jnp.int32)
        out = fp4_moe_matmul_mosaic(
            lhs, rhs, gs, interpret=pltpu.InterpretParams(), out_dtype=jnp.float32
        )
        assert_matches_reference(out, lhs, rhs, gs, exact=False)


def test_bfloat16_output_and_nan_block_stays_in_its_group():
    """bfloat16 output within one rounding of the reference; a NaN scale block of expert 2's
    output row 5 makes NaN exactly column 5 of expert 2's rows (1..130), as in the reference,
    although the kernel spreads that scale over the whole weight row."""
    lhs, clean = make_operands(fp4.MXFP4, fp4.MXFP8, m=M, k=K, n=N)
    bits = jax.lax.bitcast_convert_type(clean.scales, jnp.uint8).at[2, 5, 3].set(0xFF)  # NaN
    rhs = PackedFP4Weights(
        clean.codes, jax.lax.bitcast_convert_type(bits, clean.fmt.scale_dtype), None, clean.fmt
    )
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    out = np.asarray(mosaic(lhs, rhs, gs), np.float32)
    expected_nan = np.zeros(out.shape, bool)
    expected_nan[1:131, 5] = True
    np.testing.assert_array_equal(np.isnan(out), expected_nan)
    ref, mag = map(np.asarray, reference_and_magnitude(lhs, clean, gs))
    # One bfloat16 rounding of the float32 result (2**-9 relative) on top of the float32 bound.
    bound = 2.0**-8 * np.abs(ref) + RTOL_OF_MAGNITUDE * mag
    err = np.abs(np.delete(out, 5, 1) - np.delete(ref, 5, 1))
    assert np.all(err <= np.delete(bound, 5, 1)), err.max()


def test_no_rows():
    _, rhs = make_operands(fp4.NVFP4, None, m=M, k=K, n=N)
    out = mosaic(jnp.zeros((0, K), jnp.bfloat16), rhs, jnp.zeros((4,), jnp.int32))
    assert out.shape == (0, N) and out.dtype == jnp.bfloat16


def test_bad_inputs_raise_clear_errors():
    lhs, rhs = make_operands(fp4.NVFP4, fp4.MXFP4, m=M, k=K, n=N)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    with pytest.raises(ValueError, match="contraction mismatch"):
        mosaic(jnp.zeros((M, 2 * K), jnp.bfloat16), rhs, gs)
    with pytest.raises(ValueError, match="group_sizes must be int32"):
        mosaic(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"block_n must be a positive multiple of 128.*got 64"):
        mosaic(lhs, rhs, gs, block_n=64)
    with pytest.raises(ValueError, match=r"block_k must be a positive multiple of 256.*got 128"):
        mosaic(lhs, rhs, gs, block_k=128)
    with pytest.raises(ValueError, match=r"block_m .* multiple of 32 \(uint8 code tiles\), got 16"):
        mosaic(lhs, rhs, gs, block_m=16)  # enough for bfloat16 activations, not for codes
    with pytest.raises(NotImplementedError, match="N=256 to be a multiple of block_n=512"):
        mosaic(lhs, rhs, gs, block_n=512)
    with pytest.raises(NotImplementedError, match="K=256 to be a multiple of block_k=512"):
        mosaic(lhs, rhs, gs, block_k=512)


@pytest.mark.parametrize(("w_fmt", "a_fmt"), [(fp4.NVFP4, None), (fp4.MXFP4, fp4.MXFP8)], ids=_id)
def test_lowers_for_tpu(w_fmt, a_fmt):
    """The kernel lowers through Mosaic's Pallas rules to a TPU custom call on the CPU (neither
    compiled nor run: Mosaic's layout passes live in the TPU compiler)."""
    lhs, rhs = make_operands(w_fmt, a_fmt, m=M, k=2 * K, n=N)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    f = functools.partial(fp4_moe_matmul_mosaic, **TILES)  # interpret=None: compile for a TPU
    text = jax.jit(f).trace(lhs, rhs, gs).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
