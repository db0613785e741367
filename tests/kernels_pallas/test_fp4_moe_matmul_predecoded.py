"""The FP4 MoE matmul with its weights decoded before the call (`predecoded.py`): the shared
cases of test_fp4_moe_matmul against the float32 reference (same tolerance and reasons: exact
16-bit operands, float32 sums), the Pallas decode pass against ml_dtypes' decode, its selection by
rows per expert, its errors, its Triton lowering.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.fp4_moe_matmul import api, fp4_moe_matmul, pack_weights, predecoded
from kernels_pallas.grouped_matmul.kernel import BlockConfig
from tests.kernels_pallas.test_fp4_moe_matmul import (
    GROUP_SIZES,
    WIDE_RANGE_FORMATS,
    G,
    K,
    M,
    N,
    _Cases,
    _id,
    _pallas_call_operands,
    _wide_range,
    assert_matches_reference,
    make_operands,
)
from tests.kernels_pallas.triton_lowering import assert_lowers_to_triton_for_h200
from trace_jax import fp4

TILES = dict(block_m=16, block_n=16, block_k=32)


class TestPredecodedInterpret(_Cases):
    """Every activation and weight format, every group pattern (empty groups, rows past the
    groups), float32 and bfloat16 outputs."""

    implementation = "pallas"
    tiling: ClassVar[dict] = TILES | dict(predecode=True, interpret=True)


class TestPredecodedMosaicInterpret(_Cases):
    """The TPU form (megablox `gmm` over the decoded operands, the epilogue in XLA) with TPU
    semantics: the same cases, megablox's own tiles (N = 32 and K = 64 whole)."""

    implementation = "pallas"
    tiling: ClassVar[dict] = dict(predecode=True, interpret=pltpu.InterpretParams())


def test_predecoded_mosaic_lowers_to_megablox_for_a_tpu():
    """Built for a TPU with `predecode=True` the op is megablox's `gmm` kernel alone (no FP4
    Mosaic kernel: the weights were decoded before it)."""
    from kernels_pallas import common

    lhs, rhs = make_operands(fp4.NVFP4, fp4.NVFP4)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    f = functools.partial(fp4_moe_matmul, implementation="pallas", predecode=True)
    with common.lowering_for("tpu"):
        text = jax.jit(f).trace(lhs, rhs, gs).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1 and "fp4_moe_matmul_mosaic" not in text


@pytest.mark.parametrize(("w_fmt", "a_fmt"), WIDE_RANGE_FORMATS, ids=_id)
def test_operands_across_their_formats_range(w_fmt, a_fmt):
    """Decoded once in XLA, every operand is still exact in the dot dtype across its format's
    range (float16 for NVFP4 x NVFP4, bfloat16 otherwise; see test_fp4_moe_matmul)."""
    x = _wide_range((M, K), a_fmt, seed=5)
    lhs = x.astype(jnp.bfloat16) if a_fmt is None else fp4.quantize(x, a_fmt)
    rhs = pack_weights(_wide_range((G, N, K), w_fmt, seed=6), w_fmt)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    out = fp4_moe_matmul(
        lhs, rhs, gs, implementation="pallas", predecode=True, interpret=True,
        out_dtype=jnp.float32, **TILES,
    )  # fmt: skip
    assert_matches_reference(out, lhs, rhs, gs, exact=False)


def _decoded_by_ml_dtypes(rhs) -> np.ndarray:
    """float64 `[G, N, K]` values times 2**-14, without the global scale: each byte's low nibble
    then high nibble as ml_dtypes' E2M1, times its block's scale as ml_dtypes reads it."""
    codes = np.asarray(rhs.codes)
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scales = np.asarray(rhs.scales).astype(np.float64)
    return values * np.repeat(scales, rhs.fmt.block_size, axis=-1) * 2.0**-14


DECODE_PASS_CASES = [(fp4.NVFP4, jnp.float16), (fp4.NVFP4, jnp.bfloat16), (fp4.MXFP4, jnp.bfloat16)]


@pytest.mark.parametrize(("fmt", "dtype"), DECODE_PASS_CASES, ids=lambda v: getattr(v, "name", v))
def test_decode_pass_is_the_exact_decode(fmt, dtype):
    """The Pallas decode pass (interpreted: the PTX's jnp twin) writes each weight's exact value
    (ml_dtypes' decode in float64) in its place: both nibbles of every byte, block scales across
    the format's range, several tiles on every grid axis (N 96 in tiles of 32, K 1536 in tiles
    of 512) and the XLA fusion's bits (`decoded_weights`, the TPU path's decode)."""
    rhs = pack_weights(_wide_range((2, 96, 1536), fmt, seed=11), fmt)
    out = predecoded.decode_weights(rhs, dtype, interpret=True)
    assert out.shape == (2, 96, 1536) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float64), _decoded_by_ml_dtypes(rhs))
    xla = predecoded.decoded_weights(rhs, jnp.dtype(dtype))
    assert bool(jnp.all(jax.lax.bitcast_convert_type(out, jnp.uint16) == (
        jax.lax.bitcast_convert_type(xla, jnp.uint16)
    )))  # fmt: skip


def _weight_operand(lhs, rhs, gs, **kwargs):
    """(shape, dtype) of the weights operand (`[G, N, K or K / 2]`) of the matmul's Pallas call
    (not of the predecoded path's decode pass, which reads the packed weights)."""
    f = functools.partial(fp4_moe_matmul, implementation="pallas", interpret=True, **kwargs)
    avals = _pallas_call_operands(jax.make_jaxpr(f)(lhs, rhs, gs), skip=("fp4_weights_decode",))
    (w,) = [a for a in avals if a.shape[:2] == (G, N) and a.shape[2] >= K // 2]  # not scales
    return w.shape, w.dtype


DOT_DTYPES = [(fp4.NVFP4, fp4.NVFP4, jnp.float16), (fp4.MXFP4, None, jnp.bfloat16)]


@pytest.mark.parametrize(("w_fmt", "a_fmt", "dtype"), DOT_DTYPES)
def test_default_decodes_first_from_prefill_rows(w_fmt, a_fmt, dtype, monkeypatch):
    """By default (`PREDECODE_BY_DEFAULT`, set since timed on an H200) the kernel reads the
    packed bytes below `PREDECODE_MIN_ROWS_PER_GROUP` rows per expert (decode) and the decoded
    `[G, N, K]` 16-bit weights from there on (prefill); `predecode=` overrides either way.
    Unset, the default is the in-kernel decode at every size."""
    rows = api.PREDECODE_MIN_ROWS_PER_GROUP * G
    assert api.PREDECODE_BY_DEFAULT
    with monkeypatch.context() as unset:
        unset.setattr(api, "PREDECODE_BY_DEFAULT", False)
        assert not api.predecode_by_default(rows, G)
    packed, decoded = ((G, N, K // 2), jnp.uint8), ((G, N, K), jnp.dtype(dtype))
    for m, expected in ((rows - 1, packed), (rows, decoded)):
        lhs, rhs = make_operands(w_fmt, a_fmt, m=m)
        gs = jnp.asarray((m // 4, 0, m // 2, m // 8), jnp.int32)
        assert api.predecode_by_default(m, G) == (expected == decoded)
        assert _weight_operand(lhs, rhs, gs) == expected
        assert _weight_operand(lhs, rhs, gs, predecode=expected == packed) != expected


def test_predecoded_settings_are_checked():
    lhs, rhs = make_operands(fp4.NVFP4, fp4.NVFP4)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    run = functools.partial(fp4_moe_matmul, implementation="pallas", predecode=True)
    with pytest.raises(ValueError, match="grid apply to the in-kernel decode"):
        run(lhs, rhs, gs, interpret=True, grid="groups")
    with pytest.raises(ValueError, match="weights_left apply to the in-kernel decode"):
        run(lhs, rhs, gs, interpret=True, weights_left=True)
    with pytest.raises(ValueError, match="block_n=64 must divide N=32"):
        run(lhs, rhs, gs, interpret=True, block_n=64)
    no_rows = run(jnp.zeros((0, K), jnp.bfloat16), rhs, jnp.zeros((G,), jnp.int32), interpret=True)
    assert no_rows.shape == (0, N) and no_rows.dtype == jnp.bfloat16


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize(("w_fmt", "a_fmt"), [(fp4.NVFP4, fp4.NVFP4), (fp4.MXFP4, None)], ids=_id)
def test_lowers_to_triton_for_h200(w_fmt, a_fmt):
    """The predecoded call lowers to Triton IR for an (abstract) H200 (not compiled or run): two
    Triton calls, the weights' decode pass (its PTX decode included) and the grouped matmul."""
    lhs, rhs = make_operands(w_fmt, a_fmt)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    config = BlockConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)
    f = functools.partial(predecoded.fp4_moe_matmul_predecoded, config=config)
    text = assert_lowers_to_triton_for_h200(f, lhs, rhs, gs)
    assert text.count(plgpu.CUSTOM_CALL_TARGET_NAME) == 2
    assert 'name = "fp4_weights_decode"' in text
    assert 'name = "fp4_moe_matmul_predecoded"' in text
