"""The Mosaic (TPU) FP4 decode attention in TPU interpret mode against the float32 reference, its
in-kernel decode against the cache's own read, its tiling, its input checks, and its lowering
for a TPU.

Tolerance, per output element against the reference: `rounding.kernel_tolerance`, as for the
Triton kernel: kernel and reference each within the float32 rounding bound of exact attention
(dots and sums of n terms within n u of their sums of magnitudes, carried through the softmax;
the kernel's blocks of 128 slots rescale fewer times than the bound allows), plus for a bf16 query
the probabilities' bf16 rounding in the p . v dot and both outputs' bf16 rounding. The decoded K
and V values are exact (checked bit for bit below), so the cache adds no error of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import common
from kernels_pallas.fp4_decode_attention import fp4_decode_attention_reference
from kernels_pallas.fp4_decode_attention.mosaic import (
    DEFAULT_BLOCK_S,
    LANES,
    MosaicTiling,
    decode_fp4_planes,
    default_k_splits,
    fp4_decode_attention_mosaic,
    mosaic_tiling,
)
from tests.kernels_pallas import rounding
from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache

FORMATS = [fp4.NVFP4, fp4.MXFP4]
INTERPRET = pltpu.InterpretParams()
_reference = jax.jit(fp4_decode_attention_reference)


@dataclasses.dataclass(frozen=True)
class Case:
    """B = 2, H = 4 query heads over Hkv = 2 (G = 2), Dh = 128; S slots, lengths, tiling."""

    name: str
    slots: int
    lengths: tuple[int, int]
    block_s: int | None
    k_splits: int | None


CASES = [
    # Two full blocks of 128, one split; a length past S (counts as S) and one mid-block.
    Case("s256_one_split", 256, (999, 130), 128, 1),
    # S = 300 ends in a partial block of 44 slots; lengths 1 and S; two splits of two blocks
    # (the second split holds only the partial block).
    Case("s300_two_splits", 300, (1, 300), 128, 2),
    # Default tiling: S fits one block of DEFAULT_BLOCK_S, one split (B * Hkv = 4 >= 2 cores).
    Case("s300_defaults", 300, (300, 77), None, None),
]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _inputs(seed: int, case: Case, fmt, q_dtype=jnp.float32):
    """q [2, 4, 128] (normal draws times 1.5), packed K and V caches [2, S, 2, 128] of normal
    draws with NaN block (and global) scales in every slot >= lengths[b], lengths int32 [2]."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = (1.5 * jax.random.normal(kq, (2, 4, 128))).astype(q_dtype)
    lengths = jnp.asarray(case.lengths, jnp.int32)
    stale = jnp.arange(case.slots)[None, None, :, None] >= lengths[:, None, None, None]
    caches = []
    for key in (kk, kv):
        x = jax.random.normal(key, (2, case.slots, 2, 128), jnp.float32)
        slots = jnp.broadcast_to(jnp.arange(case.slots), (2, case.slots))
        cache = PackedTensorCache.empty(x.shape, fmt).write(fp4.quantize(x, fmt), slots)
        nan_bits = 0xFF if fmt.scale is fp4.ScaleType.E8M0 else 0x7F
        bits = jnp.where(stale, nan_bits, common.scale_bits(cache.scales)).astype(jnp.uint8)
        glob = cache.global_scale
        caches.append(
            dataclasses.replace(
                cache,
                scales=jax.lax.bitcast_convert_type(bits, fmt.scale_dtype),
                global_scale=None if glob is None else jnp.where(stale, jnp.nan, glob),
            )
        )
    return q, *caches, lengths


def _assert_close(out, q, k_cache, v_cache, lengths):
    """out against the reference within `rounding.kernel_tolerance`; no NaN from stale slots."""
    ref = _reference(q, k_cache, v_cache, lengths)
    assert out.dtype == ref.dtype == q.dtype and out.shape == q.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    k, v = (c.read(jnp.float32) for c in (k_cache, v_cache))
    bound = rounding.kernel_tolerance(q, k, v, lengths, out, ref, bf16=q.dtype == jnp.bfloat16)
    rounding.assert_within(out, ref, bound)


@pytest.mark.parametrize(
    "case, fmt",
    # Each shape once, the formats alternating (each format also meets the two-split shape in
    # `test_bf16_query_matches_reference`).
    list(zip(CASES, itertools.cycle(FORMATS), strict=False)),
    ids=lambda x: getattr(x, "name", None),
)
def test_matches_reference(case, fmt):
    q, kc, vc, lengths = _inputs(0, case, fmt)
    out = fp4_decode_attention_mosaic(
        q, kc, vc, lengths, block_s=case.block_s, k_splits=case.k_splits, interpret=INTERPRET
    )
    _assert_close(out, q, kc, vc, lengths)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bf16_query_matches_reference(fmt):
    """bf16 MXU dots over the decoded values (exact in bf16), float32 accumulation."""
    q, kc, vc, lengths = _inputs(1, CASES[1], fmt, jnp.bfloat16)
    out = fp4_decode_attention_mosaic(
        q, kc, vc, lengths, block_s=128, k_splits=2, interpret=INTERPRET
    )
    _assert_close(out, q, kc, vc, lengths)


def test_zero_length_gives_nan():
    """A sequence with no valid slot is NaN (never a silent zero); the other is unaffected."""
    case = dataclasses.replace(CASES[1], lengths=(0, 200))
    q, kc, vc, lengths = _inputs(2, case, fp4.MXFP4)
    out = fp4_decode_attention_mosaic(
        q, kc, vc, lengths, block_s=128, k_splits=2, interpret=INTERPRET
    )
    assert np.isnan(np.asarray(out[0])).all()
    ref = _reference(q, kc, vc, lengths)
    k, v = (c.read(jnp.float32)[1:] for c in (kc, vc))
    bound = rounding.kernel_tolerance(q[1:], k, v, lengths[1:], out[1:], ref[1:], bf16=False)
    rounding.assert_within(out[1:], ref[1:], bound)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_decode_equals_cache_read(fmt):
    """The kernel's planes (scale blocks expanded over lanes), times NVFP4's global scale and
    interleaved, are the cache's dequantized values; a NaN block scale stays in its block.

    Bit for bit for MXFP4 (power-of-two scales); for NVFP4 within 2**-22 relative: the kernel's
    code * block_scale is exact and takes the global scale in one rounding, the read rounds
    block_scale * global_scale and then its product with the code (two roundings of 2**-24)."""
    x = 3.0 * jax.random.normal(jax.random.key(3), (1, 16, 2, 128))
    slots = jnp.arange(16)[None]
    cache = PackedTensorCache.empty(x.shape, fmt).write(fp4.quantize(x, fmt), slots)
    codes = cache.codes.reshape(-1, 64)
    bits = common.scale_bits(cache.scales).reshape(codes.shape[0], -1)
    bits = bits.at[0, 1].set(0xFF if fmt.scale is fp4.ScaleType.E8M0 else 0x7F)
    decode = jax.jit(decode_fp4_planes, static_argnums=(2, 3))
    even, odd = decode(codes, bits, fmt, jnp.float32)
    values = np.array(jnp.stack([even, odd], axis=-1).reshape(codes.shape[0], 128))
    if cache.global_scale is not None:
        values = values * np.asarray(cache.global_scale).reshape(-1, 1)
    want = np.asarray(jnp.swapaxes(cache.read(jnp.float32), 1, 2)).reshape(-1, 128)
    block = fmt.block_size
    assert np.isnan(values[0, block : 2 * block]).all()
    assert np.isfinite(np.delete(values[0], np.s_[block : 2 * block])).all()
    values[0, block : 2 * block] = want[0, block : 2 * block]
    np.testing.assert_allclose(values, want, rtol=2.0**-22 if fmt.has_global_scale else 0, atol=0)
    bf16_even, _ = decode(codes, bits, fmt, jnp.bfloat16)  # exact in bf16 too
    np.testing.assert_array_equal(np.asarray(bf16_even, np.float32), np.asarray(even))


def test_tiling():
    """block_s capped at S (one block), splits never empty, default splits fill two cores."""
    assert mosaic_tiling(2, 300, 2, None, None) == MosaicTiling(300, 1, 1)
    assert DEFAULT_BLOCK_S % LANES == 0
    assert mosaic_tiling(2, 300, 2, 128, 2) == MosaicTiling(128, 2, 2)
    # 8 blocks of 128 in 3 splits: 3 blocks each, the last split 2.
    assert mosaic_tiling(1, 1000, 1, 128, 3) == MosaicTiling(128, 3, 3)
    assert mosaic_tiling(1, 1000, 1, 512, 50) == MosaicTiling(512, 1, 2)
    assert default_k_splits(1, 1) == 2 and default_k_splits(2, 1) == default_k_splits(4, 8) == 1
    assert mosaic_tiling(1, 1024, 1, 256, None).k_splits == 2
    with pytest.raises(ValueError, match=r"no slots \(S = 0\)"):
        mosaic_tiling(1, 0, 1, None, None)


@functools.cache
def _small_inputs():
    return _inputs(4, Case("small", 128, (128, 5), 128, 1), fp4.NVFP4)


@pytest.mark.parametrize(
    "mutate, options, match",
    [
        (lambda q, kc, vc, n: (q.astype(jnp.float16), kc, vc, n), {}, "bfloat16 or float32"),
        (lambda q, kc, vc, n: (q[:, :3], kc, vc, n), {}, "multiple of the cache's 2 kv heads"),
        (lambda q, kc, vc, n: (q, kc, vc, n.astype(jnp.float32)), {}, r"lengths must be int \[2\]"),
        (lambda q, kc, vc, n: (q, kc, kc.read(jnp.float32), n), {}, "v_cache must be a Packed"),
        (
            lambda q, kc, vc, n: (q, kc, dataclasses.replace(vc, global_scale=None), n),
            {},
            r"v_cache.global_scale must be \[B, Hkv, S, 1\]",
        ),
        (
            lambda q, kc, vc, n: (q, kc, PackedTensorCache.empty(kc.shape, fp4.MXFP4), n),
            {},
            "same format and shape",
        ),
        (lambda *a: a, {"block_s": 64}, "block_s must be a positive multiple of 128"),
        (lambda *a: a, {"k_splits": 0}, "k_splits must be a positive int"),
    ],
)
def test_bad_inputs_raise(mutate, options, match):
    with pytest.raises(ValueError, match=match):
        fp4_decode_attention_mosaic(*mutate(*_small_inputs()), interpret=INTERPRET, **options)


@pytest.mark.parametrize(
    "fmt, q_dtype",
    [(fp4.NVFP4, jnp.bfloat16), (fp4.MXFP4, jnp.float32)],
    ids=["nvfp4_bf16", "mxfp4_f32"],
)
def test_lowers_for_tpu(fmt, q_dtype):
    """The kernel lowers through Pallas' Mosaic rules to a `tpu_custom_call` for a serving shape
    (S = 1000: a partial last block; G = 4; two splits). Mosaic's layout passes run only in the
    TPU compiler, so a real TPU still has the last word on tiling."""
    b, s, hkv, g, dh = 2, 1000, 8, 4, 128
    q = jax.ShapeDtypeStruct((b, hkv * g, dh), q_dtype)
    cache = jax.eval_shape(lambda: PackedTensorCache.empty((b, s, hkv, dh), fmt))
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    op = functools.partial(fp4_decode_attention_mosaic, block_s=256, k_splits=2)
    lowered = jax.jit(op).trace(q, cache, cache, lengths).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
