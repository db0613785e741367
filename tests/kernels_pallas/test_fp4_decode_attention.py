"""Decode attention over a packed FP4 / bf16 KV cache: every implementation against the float32
reference.

One test base runs the shared cases through the api with a given implementation; each
implementation is a short subclass. Pallas runs in interpret mode off the GPU (natively on one).
Tolerance, per output element against the reference: `rounding.kernel_tolerance`, twice the
float32 rounding bound (dots and sums of n terms within n u of their sums of magnitudes, carried
through the softmax), plus for a bf16 query the probabilities' bf16 rounding in the p . v dot and
both outputs' bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import common
from kernels_pallas.common import Implementation
from kernels_pallas.fp4_decode_attention import (
    DEFAULT_BLOCK_S,
    FP4_DEFAULT_BLOCK_S,
    FP4_LONG_CONTEXT_NUM_STAGES,
    FP4_LONG_CONTEXT_SLOTS,
    FP4_PV_TRANSPOSED_MIN_HEAD_DIM,
    FP4_TARGET_PROGRAMS,
    bf16_decode_attention,
    bf16_decode_attention_plan,
    bf16_decode_attention_reference,
    decode_attention_reference,
    default_k_splits,
    fp4_decode_attention,
    fp4_decode_attention_plan,
    fp4_decode_attention_reference,
    kernel,
)
from kernels_pallas.fp4_decode_attention.kernel import decode_fp4_planes, decode_fp4_planes_f16
from tests.kernels_pallas import rounding
from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache

# One worker runs the module: its cases share compiled kernels and references.
pytestmark = [
    pytest.mark.usefixtures("pallas_interpreted_on_cpu"),
    pytest.mark.xdist_group("fp4_decode_attention"),
]

FORMATS = [fp4.NVFP4, fp4.MXFP4]
# The references, jitted as the api's "xla" implementation runs them (one compile per shape).
_fp4_ref = jax.jit(fp4_decode_attention_reference)
_bf16_ref = jax.jit(bf16_decode_attention_reference)


@dataclasses.dataclass(frozen=True)
class Case:
    """A named shape: B, S, Hkv, G, Dh, per-sequence lengths and the kernel's tiling."""

    name: str
    batch: int
    slots: int
    kv_heads: int
    group: int
    head_dim: int
    lengths: tuple[int, ...]
    block_s: int | None = None
    k_splits: int | None = None


CASES = {
    c.name: c
    for c in [
        # S = 150 is not a multiple of block_s = 32; lengths ragged, one of 1, one past S.
        Case("ragged_one_split", 3, 150, 2, 2, 64, (150, 1, 77), block_s=32, k_splits=1),
        Case("ragged_three_splits", 3, 150, 2, 2, 64, (200, 1, 77), block_s=32, k_splits=3),
        # GQA G = 4, Dh = 32 (one MXFP4 block), default k_splits (one split per block of 16).
        Case("gqa4_default_splits", 2, 40, 2, 4, 32, (40, 17), block_s=16),
        # MHA (G = 1), default tiling (block_s 64 > S).
        Case("mha_defaults", 2, 45, 2, 1, 32, (3, 45)),
    ]
}


def _inputs(case: Case, q_dtype, seed: int = 0):
    """q [B, H, Dh], k, v [B, S, Hkv, Dh] float32 normal draws (never zero), lengths int32 [B]."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    b, s, hkv, dh = case.batch, case.slots, case.kv_heads, case.head_dim
    q = (1.5 * jax.random.normal(kq, (b, hkv * case.group, dh))).astype(q_dtype)
    k = jax.random.normal(kk, (b, s, hkv, dh), jnp.float32)
    v = jax.random.normal(kv, (b, s, hkv, dh), jnp.float32)
    return q, k, v, jnp.asarray(case.lengths, jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def _packed(x: jax.Array, fmt) -> PackedTensorCache:
    """x [B, S, Hkv, Dh] written to every slot of a packed cache (jitted: one compile per shape)."""
    b, s = x.shape[:2]
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    return PackedTensorCache.empty(x.shape, fmt).write(fp4.quantize(x, fmt), slots)


def _stale_nan(cache: PackedTensorCache, lengths: jax.Array) -> PackedTensorCache:
    """The cache with NaN scales (and global scales) at every slot >= lengths[b]."""
    stale = jnp.arange(cache.shape[1])[None, :] >= lengths[:, None]  # [B, S]
    stale = stale[:, None, :, None]  # the head-major arrays' [B, Hkv, S, ...]
    nan_bits = 0xFF if cache.fmt.scale is fp4.ScaleType.E8M0 else 0x7F
    bits = jnp.where(stale, nan_bits, common.scale_bits(cache.scales))
    scales = jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), cache.fmt.scale_dtype)
    g = cache.global_scale
    if g is not None:
        g = jnp.where(stale, jnp.nan, g)
    return dataclasses.replace(cache, scales=scales, global_scale=g)


def _values(k, v):
    """K and V as the reference reads them (a packed cache dequantized in float32)."""
    return (c.read(jnp.float32) if isinstance(c, PackedTensorCache) else c for c in (k, v))


def _close(out, ref, q, k, v, lengths):
    """out against the reference's ref, both in q.dtype, within `rounding.kernel_tolerance`."""
    assert out.dtype == ref.dtype == q.dtype
    bound = rounding.kernel_tolerance(
        q, *_values(k, v), lengths, out, ref, bf16=q.dtype == jnp.bfloat16
    )
    rounding.assert_within(out, ref, bound)


class DecodeAttentionTestBase:
    """Shared cases; subclasses set `implementation`."""

    implementation: str
    decode: str | None = None

    def fp4_op(self, q, k_cache, v_cache, lengths, case: Case):
        return fp4_decode_attention(
            q,
            k_cache,
            v_cache,
            lengths,
            implementation=self.implementation,
            k_splits=case.k_splits,
            block_s=case.block_s,
            decode=self.decode,
        )

    def bf16_op(self, q, k, v, lengths, case: Case):
        return bf16_decode_attention(
            q,
            k,
            v,
            lengths,
            implementation=self.implementation,
            k_splits=case.k_splits,
            block_s=case.block_s,
        )

    @pytest.mark.parametrize(
        "case, fmt",
        # Each shape once, the formats alternating: both formats meet both tilings (one and
        # several splits); the format tests below take each format on one more shape.
        list(zip(CASES.values(), itertools.cycle(FORMATS), strict=False)),
        ids=lambda x: getattr(x, "name", None),
    )
    def test_fp4_matches_reference(self, case, fmt):
        q, k, v, lengths = _inputs(case, jnp.float32)
        kc, vc = _packed(k, fmt), _packed(v, fmt)
        out = self.fp4_op(q, kc, vc, lengths, case)
        _close(out, _fp4_ref(q, kc, vc, lengths), q, kc, vc, lengths)

    @pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
    def test_fp4_bf16_query(self, fmt):
        case = CASES["ragged_three_splits"]
        q, k, v, lengths = _inputs(case, jnp.bfloat16, seed=1)
        kc, vc = _packed(k, fmt), _packed(v, fmt)
        out = self.fp4_op(q, kc, vc, lengths, case)
        _close(out, _fp4_ref(q, kc, vc, lengths), q, kc, vc, lengths)

    @pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
    def test_fp4_stale_slots_are_never_read(self, fmt):
        """NaN scales past lengths[b] (stale or never-written slots) do not reach the output."""
        case = CASES["ragged_three_splits"]
        q, k, v, lengths = _inputs(case, jnp.float32, seed=2)
        kc, vc = _packed(k, fmt), _packed(v, fmt)
        out = self.fp4_op(q, _stale_nan(kc, lengths), _stale_nan(vc, lengths), lengths, case)
        assert np.isfinite(np.asarray(out)).all()
        _close(out, _fp4_ref(q, kc, vc, lengths), q, kc, vc, lengths)

    def test_zero_length_gives_nan(self):
        """A sequence with no valid slot is NaN (never a silent zero); the others are unaffected."""
        case = CASES["ragged_three_splits"]
        q, k, v, _ = _inputs(case, jnp.float32, seed=7)
        kc, vc = _packed(k, fp4.MXFP4), _packed(v, fp4.MXFP4)
        lengths = jnp.asarray([0, 1, 77], jnp.int32)
        out = self.fp4_op(q, kc, vc, lengths, case)
        assert np.isnan(np.asarray(out[0])).all()
        _close(out[1:], _fp4_ref(q, kc, vc, lengths)[1:], q[1:], kc.read(jnp.float32)[1:],
               vc.read(jnp.float32)[1:], lengths[1:])  # fmt: skip

    @pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=["f32_q", "bf16_q"])
    def test_bf16_cache_matches_reference(self, q_dtype):
        """The bf16 twin, with NaN in every stale slot of K and V."""
        case = CASES["ragged_three_splits"]
        q, k, v, lengths = _inputs(case, q_dtype, seed=3)
        stale = jnp.arange(case.slots)[None, :, None, None] >= lengths[:, None, None, None]
        k, v = (jnp.where(stale, jnp.nan, x).astype(jnp.bfloat16) for x in (k, v))
        out = self.bf16_op(q, k, v, lengths, case)
        _close(out, _bf16_ref(q, k, v, lengths), q, k, v, lengths)


class TestPallas(DecodeAttentionTestBase):
    implementation = "pallas"
    decode = "e4m3"


class TestPallasF16Decode(DecodeAttentionTestBase):
    """The float16 word-decode kernel (its jnp twin of the PTX in interpret mode)."""

    implementation = "pallas"
    decode = "f16"


class TestXla(DecodeAttentionTestBase):
    implementation = "xla"


# -------------------------------------------------------------------------------------------------
# The reference, the in-kernel decode and the dispatcher.


def test_reference_matches_per_head_loop():
    """GQA mapping (head h reads kv head h // G), scale Dh**-0.5 and the length mask, in float64:
    the float32 reference within its own rounding bound of a per-head loop."""
    case = CASES["gqa4_default_splits"]
    q, k, v, lengths = _inputs(case, jnp.float32, seed=4)
    out = np.asarray(decode_attention_reference(q, k, v, lengths), np.float64)
    _, bound = rounding.attention_error_bound(q, k, v, lengths, steps=1)  # one softmax
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    for b in range(case.batch):
        n = int(lengths[b])
        for h in range(case.kv_heads * case.group):
            kh = h // case.group
            scores = kn[b, :n, kh] @ qn[b, h] / np.sqrt(case.head_dim)
            p = np.exp(scores - scores.max())
            expected = (p / p.sum()) @ vn[b, :n, kh]
            rounding.assert_within(out[b, h], expected, bound[b, h])


def _three_split_case(fmt, q_dtype, seed: int):
    """The ragged three-split case for the FP4 kernel (`fmt`) or the bf16 twin (None) ->
    (the default plan, the kernel, its arguments)."""
    case = CASES["ragged_three_splits"]
    q, k, v, lengths = _inputs(case, q_dtype, seed=seed)
    tiling = dict(
        implementation="pallas", k_splits=case.k_splits, block_s=case.block_s, interpret=True
    )
    if fmt is None:
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        plan = bf16_decode_attention_plan(q, k, v, lengths, **tiling)
        op, args = kernel.bf16_decode_attention_pallas, (q, k, v, lengths)
    else:
        kc, vc = _packed(k, fmt), _packed(v, fmt)
        plan = fp4_decode_attention_plan(q, kc, vc, lengths, **tiling)
        op, args = kernel.fp4_decode_attention_pallas, (q, kc, vc, lengths)
    assert plan.config.k_splits(case.slots) == 3
    return plan, op, args


@pytest.mark.parametrize("fmt", [*FORMATS, None], ids=["nvfp4", "mxfp4", "bf16_cache"])
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_transposed_pv_accumulates_the_same_output(fmt, q_dtype):
    """acc^T += V^T . p^T sums the products of acc += p . V: the default order's output to
    float32 rounding (several splits, ragged lengths), and the reference's."""
    plan, op, args = _three_split_case(fmt, q_dtype, seed=12)
    assert not plan.config.pv_transposed
    want = np.asarray(op(*args, config=plan.config, interpret=True), np.float64)
    transposed = dataclasses.replace(plan.config, pv_transposed=True)
    out = op(*args, config=transposed, interpret=True)
    assert out.dtype == q_dtype and np.isfinite(want).all() and np.abs(want).max() > 0.1
    # The same probabilities and values, summed in another order per block of block_s slots:
    # each order within (block_s + 2) u sum_j P_j |v_j| (the dot, its scale, the rescale) of
    # exact, plus both outputs' rounding to bf16.
    q, k, v, lengths = args
    mag = rounding.pv_magnitude(q, *_values(k, v), lengths)
    bound = 2 * (plan.config.block_s + 2) * rounding.U32 * mag
    if q_dtype == jnp.bfloat16:
        bound = bound + rounding.U_BF16 * (np.abs(np.asarray(out, np.float64)) + np.abs(want))
    rounding.assert_within(out, want, bound)
    ref = _fp4_ref(*args) if fmt is not None else _bf16_ref(*args)
    _close(out, ref, *args)


def test_api_passes_pv_transposed_to_the_kernel():
    """`fp4_decode_attention(pv_transposed=...)` runs the kernel with that option: its output is
    the kernel's under the transposed config, bit for bit; None keeps the plan's default."""
    plan, op, args = _three_split_case(fp4.NVFP4, jnp.bfloat16, seed=13)
    case = CASES["ragged_three_splits"]
    tiling = dict(
        implementation="pallas", k_splits=case.k_splits, block_s=case.block_s, interpret=True
    )
    for flag in (True, False):
        got_plan = fp4_decode_attention_plan(*args, pv_transposed=flag, **tiling)
        assert got_plan.config == dataclasses.replace(plan.config, pv_transposed=flag)
        want = op(*args, config=got_plan.config, interpret=True)
        got = fp4_decode_attention(*args, pv_transposed=flag, **tiling)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert fp4_decode_attention_plan(*args, **tiling).config == plan.config
    with pytest.raises(ValueError, match="pv_transposed must be a bool"):
        fp4_decode_attention_plan(*args, pv_transposed="yes", **tiling)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pv_transposed_is_the_default_from_head_dim_128(head_dim):
    """The FP4 plan transposes p . v from head_dim 128 on with the "f16" decode (faster there on
    the H200, much slower at 64 or with "e4m3"); the bf16 twin keeps
    the untransposed order."""
    b, s, hkv, g = 2, 40, 2, 4
    q = jnp.zeros((b, hkv * g, head_dim), jnp.bfloat16)
    cache = PackedTensorCache.empty((b, s, hkv, head_dim), fp4.NVFP4)
    lengths = jnp.full((b,), s, jnp.int32)
    plan = fp4_decode_attention_plan(
        q, cache, cache, lengths, implementation="pallas", interpret=True
    )
    assert FP4_PV_TRANSPOSED_MIN_HEAD_DIM == 128
    assert plan.config.pv_transposed == (head_dim >= 128)
    e4m3 = fp4_decode_attention_plan(q, cache, cache, lengths, decode="e4m3", interpret=True)
    assert not e4m3.config.pv_transposed  # slower with the FP8 decode
    kv = jnp.zeros((b, s, hkv, head_dim), jnp.bfloat16)
    twin = bf16_decode_attention_plan(q, kv, kv, lengths, implementation="pallas", interpret=True)
    assert not twin.config.pv_transposed


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernel_decode_equals_cache_read(fmt):
    """The kernel's FP8-aligned nibble planes, times their scales and 2**6, interleaved, give the
    quantizer's values exactly."""
    x = 2.0 * jax.random.normal(jax.random.key(5), (2, 8, 2, 64))
    cache = _packed(x, fmt)
    codes = cache.codes.reshape(-1, 32)
    bits = common.scale_bits(cache.scales).reshape(-1, 64 // fmt.block_size)
    even, odd = jax.jit(decode_fp4_planes, static_argnums=(2, 3))(codes, bits, fmt, jnp.float32)
    rows_shape = cache.codes.shape[:3]  # head-major [B, Hkv, S]
    values = jnp.stack([even, odd], axis=-1).reshape(*rows_shape, 64) / common.E4M3_ALIGN
    if cache.global_scale is not None:
        values = values * cache.global_scale
    expected = jax.jit(PackedTensorCache.read, static_argnums=1)(cache, jnp.float32)
    expected = jnp.swapaxes(expected, 1, 2)  # [B, S, Hkv, Dh] -> the arrays' [B, Hkv, S, Dh]
    # (code * scale) * global vs the reader's order of the two products: 1 ulp
    np.testing.assert_allclose(np.asarray(values), np.asarray(expected), rtol=2e-7)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernel_f16_decode_equals_cache_read(fmt):
    """The float16 planes (split by scale block) times their row factor and 2**14, interleaved,
    give the quantizer's values (exactly for NVFP4's element part; MXFP4 rows here span < 2**24)."""
    x = 2.0 * jax.random.normal(jax.random.key(5), (2, 8, 2, 64))
    cache = _packed(x, fmt)
    rows, nb = 2 * 8 * 2, 64 // fmt.block_size
    codes = cache.codes.reshape(rows, nb, fmt.block_size // 2)
    bits = common.scale_bits(cache.scales).reshape(rows, nb)
    glob = None if cache.global_scale is None else cache.global_scale.reshape(rows)
    decode = functools.partial(decode_fp4_planes_f16, fmt=fmt, dtype=jnp.float32, inline_asm=False)
    (even, odd), row = jax.jit(decode)(codes, bits, glob)
    values = jnp.stack([even, odd], axis=-1) * row[:, None, None] / common.F16_ALIGN
    expected = jax.jit(PackedTensorCache.read, static_argnums=1)(cache, jnp.float32)
    expected = jnp.swapaxes(expected, 1, 2)  # [B, S, Hkv, Dh] -> the arrays' [B, Hkv, S, Dh]
    got = np.asarray(values).reshape(*cache.codes.shape[:3], 64)
    np.testing.assert_allclose(got, np.asarray(expected), rtol=2e-7)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_xla_implementation_is_the_reference_exactly(fmt):
    case = CASES["ragged_three_splits"]
    q, k, v, lengths = _inputs(case, jnp.bfloat16, seed=6)
    kc, vc = _packed(k, fmt), _packed(v, fmt)
    out = fp4_decode_attention(q, kc, vc, lengths, implementation="xla")
    np.testing.assert_array_equal(out, _fp4_ref(q, kc, vc, lengths))
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    out = bf16_decode_attention(q, kb, vb, lengths, implementation="xla")
    np.testing.assert_array_equal(out, _bf16_ref(q, kb, vb, lengths))
    # Also equal to the eager reference to rounding (XLA may fuse differently under jit).
    _close(out, bf16_decode_attention_reference(q, kb, vb, lengths), q, kb, vb, lengths)


def test_plan_defaults_and_implementation_choice(monkeypatch):
    case = CASES["ragged_three_splits"]
    q, k, v, lengths = _inputs(case, jnp.bfloat16)
    kc, vc = _packed(k, fp4.NVFP4), _packed(v, fp4.NVFP4)

    monkeypatch.setattr(common, "kernel_platform", lambda: "cpu")  # as on the CPU, also on a GPU
    plan = fp4_decode_attention_plan(q, kc, vc, lengths)  # CPU: the default is the reference
    assert plan.implementation is Implementation.XLA and plan.fallback is None
    assert plan.config.block_s == FP4_DEFAULT_BLOCK_S and plan.config.block_g == 16
    assert plan.config.num_stages == 2  # a short cache: BlockConfig's default
    assert fp4_decode_attention_plan(q, kc, vc, lengths, num_stages=4).config.num_stages == 4
    # From FP4_LONG_CONTEXT_SLOTS slots on, three load stages (unless given).
    for slots, want in ((FP4_LONG_CONTEXT_SLOTS - 128, 2), (FP4_LONG_CONTEXT_SLOTS, 3)):
        long_kc, long_vc = (
            PackedTensorCache.empty((3, slots, 2, kc.shape[-1]), fp4.NVFP4) for _ in range(2)
        )
        long_plan = fp4_decode_attention_plan(q, long_kc, long_vc, lengths)
        assert long_plan.config.num_stages == want
    assert FP4_LONG_CONTEXT_NUM_STAGES == 3
    # 8 * 132 target programs over B * Hkv = 6, capped at the 2 blocks of 128 in S = 150.
    assert default_k_splits(3, 2, 150, 128, FP4_TARGET_PROGRAMS) == plan.k_splits == 2
    assert default_k_splits(3, 2, 150, 64) == 3  # the bf16 twin: 264 programs, 3 blocks of 64
    assert default_k_splits(8, 8, 32768, 64) == 5  # long context: ~2 programs per SM
    twin = bf16_decode_attention_plan(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), lengths)
    assert (twin.config.block_s, twin.k_splits, twin.config.num_stages) == (DEFAULT_BLOCK_S, 3, 2)
    plan = fp4_decode_attention_plan(
        q, kc, vc, lengths, implementation="pallas", k_splits=4, block_s=16
    )
    assert (plan.implementation, plan.interpret) == (Implementation.PALLAS, True)
    assert (plan.config.decode, plan.config.num_warps) == (kernel.DEFAULT_DECODE, 4)
    tuned = fp4_decode_attention_plan(q, kc, vc, lengths, decode="e4m3", num_warps=8)
    assert (tuned.config.decode, tuned.config.num_warps) == ("e4m3", 8)
    with pytest.raises(ValueError, match="decode must be one of"):
        fp4_decode_attention_plan(q, kc, vc, lengths, decode="int8")
    # 10 blocks of 16 in 4 splits: chunks of 48 slots, and no empty split.
    assert (plan.config.chunk, plan.k_splits) == (48, 4)
    plan = fp4_decode_attention_plan(
        q, kc, vc, lengths, implementation="pallas", k_splits=50, block_s=64
    )
    assert (plan.config.chunk, plan.k_splits) == (64, 3)

    monkeypatch.setattr(common, "kernel_platform", lambda: "gpu")
    plan = fp4_decode_attention_plan(q, kc, vc, lengths, interpret=False)  # native
    assert (plan.implementation, plan.interpret) == (Implementation.PALLAS, False)
    # Dh = 48 is not a power of two: no Triton kernel; the default and ("pallas", "xla") fall
    # back, "pallas" alone refuses.
    q48, k48 = q[..., :48], k[..., :48]
    kc48 = _packed(k48, fp4.NVFP4)
    for implementation in (None, ("pallas", "xla")):
        plan = fp4_decode_attention_plan(
            q48, kc48, kc48, lengths, implementation=implementation, interpret=False
        )
        assert plan.implementation is Implementation.XLA and "head_dim 48" in plan.fallback
    with pytest.raises(NotImplementedError, match="head_dim 48"):
        fp4_decode_attention_plan(
            q48, kc48, kc48, lengths, implementation="pallas", interpret=False
        )
    plan = bf16_decode_attention_plan(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), lengths)
    assert plan.implementation is Implementation.PALLAS
    plan = fp4_decode_attention_plan(q, kc, vc, lengths, implementation="xla")
    assert plan.implementation is Implementation.XLA and plan.fallback is None


@functools.cache
def _error_inputs():
    case = Case("err", 2, 20, 2, 2, 32, (20, 5))
    q, k, v, lengths = _inputs(case, jnp.float32)
    return q, _packed(k, fp4.NVFP4), _packed(v, fp4.NVFP4), lengths


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, kc, vc, n: (q[0], kc, vc, n), r"q must be \[B, H, Dh\]"),
        (lambda q, kc, vc, n: (q.astype(jnp.float16), kc, vc, n), "bfloat16 or float32"),
        (lambda q, kc, vc, n: (q[:, :3], kc, vc, n), "not a multiple of the cache's 2 kv heads"),
        (lambda q, kc, vc, n: (q[..., :16], kc, vc, n), "head_dim 16 but the cache has .* 32"),
        (lambda q, kc, vc, n: (q[:1], kc, vc, n), "batch 1 but the cache has batch 2"),
        (lambda q, kc, vc, n: (q, kc, vc, n[:, None]), r"lengths must have shape \(2,\)"),
        (lambda q, kc, vc, n: (q, kc, vc, n.astype(jnp.float32)), "lengths must be integers"),
        (lambda q, kc, vc, n: (q, kc, kc.read(jnp.float32), n), "v_cache must be a Packed"),
        (
            lambda q, kc, vc, n: (q, kc, _packed(kc.read(jnp.float32), fp4.MXFP4), n),
            "same format and shape",
        ),
    ],
)
def test_bad_inputs_raise(mutate, match):
    with pytest.raises(ValueError, match=match):
        fp4_decode_attention(*mutate(*_error_inputs()), implementation="xla")


def test_bad_options_and_bf16_inputs_raise():
    q, kc, vc, lengths = _error_inputs()
    with pytest.raises(ValueError, match="block_s must be a power of two"):
        fp4_decode_attention(q, kc, vc, lengths, implementation="pallas", block_s=24)
    with pytest.raises(ValueError, match="k_splits must be a positive int"):
        fp4_decode_attention(q, kc, vc, lengths, implementation="pallas", k_splits=0)
    with pytest.raises(ValueError, match=r"implementation must be None, one of .* got 'cuda'"):
        fp4_decode_attention(q, kc, vc, lengths, implementation="cuda")
    k = kc.read(jnp.bfloat16)
    with pytest.raises(ValueError, match="k must be bfloat16"):
        bf16_decode_attention(q, k.astype(jnp.float32), k, lengths)
    with pytest.raises(ValueError, match=r"k .* and v .* must have the same shape"):
        bf16_decode_attention(q, k, k[:, :10], lengths)
    with pytest.raises(ValueError, match="not a multiple of the bf16 cache's 2 kv heads"):
        bf16_decode_attention(q[:, :3], k, k, lengths)


@pytest.mark.parametrize(
    "fmt, decode",
    [
        (fp4.NVFP4, "e4m3"),
        (fp4.MXFP4, "e4m3"),
        (fp4.NVFP4, "f16"),
        (fp4.MXFP4, "f16"),
        (None, None),
        (fp4.NVFP4, "f16/pv_transposed"),
        (None, "f16/pv_transposed"),  # the bf16 cache ignores `decode`
    ],
    ids=[
        "nvfp4_e4m3",
        "mxfp4_e4m3",
        "nvfp4_f16",
        "mxfp4_f16",
        "bf16_cache",
        "nvfp4_pv_transposed",
        "bf16_pv_transposed",
    ],
)
@pytest.mark.parametrize("gpu", ["H200", "B200"])
def test_lowers_through_triton_without_a_gpu(triton_lowering, gpu, fmt, decode):
    """The kernel body lowers to Triton IR (power-of-two tensors, supported primitives) for an
    H200 and a B200 with a serving shape (S not a multiple of the chunk); PTX compilation needs a
    GPU."""
    triton_lowering(plgpu.GpuVersion[gpu])
    b, s, hkv, g, dh = 2, 1000, 8, 4, 128
    q = jax.ShapeDtypeStruct((b, hkv * g, dh), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    decode, _, order = (decode or kernel.DEFAULT_DECODE).partition("/")
    config = kernel.BlockConfig(
        block_s=DEFAULT_BLOCK_S,
        chunk=128,
        block_g=16,
        decode=decode,
        pv_transposed=order == "pv_transposed",
    )
    if fmt is None:
        cache = jax.ShapeDtypeStruct((b, s, hkv, dh), jnp.bfloat16)
        op = kernel.bf16_decode_attention_pallas
    else:
        cache = jax.eval_shape(lambda: PackedTensorCache.empty((b, s, hkv, dh), fmt))
        op = kernel.fp4_decode_attention_pallas
    op = functools.partial(op, config=config, interpret=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        lowered = jax.jit(op).trace(q, cache, cache, lengths).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert triton_lowering.queried == [plgpu.GpuVersion[gpu]]  # lowered for that GPU
