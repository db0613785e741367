"""Pallas flash-decoding of one new query token per sequence over a packed FP4 (or bf16) KV cache.

Why: decoding is bound by reading the cache. Per token and kv head, one K (or V) row costs
  NVFP4: Dh/2 code bytes + Dh/16 E4M3 scale bytes + 4 bytes of float32 global scale (Dh=128: 76 B),
  MXFP4: Dh/2 + Dh/32 E8M0 scale bytes (Dh=128: 68 B),
  bf16:  2 * Dh bytes (Dh=128: 256 B),
so a kernel that reads the packed bytes and decodes them in registers moves 3.4x (NVFP4) to 3.8x
(MXFP4) fewer bytes than dequantizing the cache to bf16 first. `bf16_decode_attention_pallas` is
the same kernel over a bf16 cache, the baseline it is measured against.

Structure (split-K flash-decoding). Grid (B, Hkv, k_splits): program (b, h, j) takes the G query
heads of kv head h together (one K/V read serves all G; the tile is zero-padded to `block_g` rows,
at least 16 for Triton's dot) and the slots [j * chunk, (j + 1) * chunk) of sequence b. It loops
over blocks of `block_s` slots with an online softmax (running max m, sum l, accumulator acc, all
float32), stopping at the first block past `lengths[b]`, and writes its partial (m, l, acc). A
small jnp step (`combine_partials`) merges the k_splits partials by log-sum-exp. Loads are masked
at `lengths[b]`: slots at or past it (stale data, or past the end of the cache when S is not a
multiple of the chunk) are never read, read as zeros, and get probability zero, so no padding copy
of the cache is made.

FP4 decode in the kernel, two variants (`BlockConfig.decode`):
  "f16" (default, `decode_fp4_planes_f16`): the codes arrive split by scale block
    ([S, NB, block/2] per (b, h)); whole 32-bit words of packed bytes become float16 planes by
    inline PTX (`common.fp4_planes_as_f16`: value * 2**-14, exact; interpret mode runs the same bit
    mapping in jnp), times the block scales in float16 (exact for NVFP4; MXFP4 relative to the row's
    largest scale, `common.split_block_scales`), float16 dots against a query normalized by a power
    of two; the row factors (NVFP4 global scale, MXFP4 largest block scale) go on the scores and,
    divided by the block's largest, on the probabilities that weight V.
  "e4m3" (`decode_fp4_planes`): each nibble becomes an E4M3 byte (`common.fp4_planes_as_e4m3`:
    value * 2**-6, exact), hardware FP8 -> bf16, times the block scales (exact in bf16), bf16 dots.
Both contract even and odd element planes separately ([block_s, Dh/2] each; the query is split
outside, the output planes p @ v_even, p @ v_odd are interleaved after the kernel), so the kernel
never interleaves nibbles; the alignment factor is undone on the scores and the output. A float32
query runs float32 dots (IEEE, not TF32). Measured on the H200 at 128K, paper-like shape:
compare/select decode 4.0 ms, "e4m3" 1.9-2.1 ms, "f16" 1.48 ms, 1.27-1.45 ms with the FP4 launch
defaults, 1.21-1.36 ms with three load stages, 1.05 ms over the head-major cache
(`PackedTensorCache` stores [B, Hkv, S, ...]: one program's rows contiguous; the slot-major layout
loaded at half the read bandwidth), 1.01 ms with p . v transposed (`BlockConfig.pv_transposed`, the
default from head_dim 128): as fast as the bf16 twin, 29% of the read bandwidth. By a
stage-by-stage ablation the loads alone now run at 76% of the read bandwidth (0.40 ms) and decode,
q . k and the online softmax add about 0.6 ms that the FP4 bytes are too few to hide.

Hopper-specific: the "f16" decode's inline PTX (valid on any NVIDIA GPU, timed only on the
H200), the "e4m3" decode's FP8 -> bf16 convert (sm_89 on), and the launch defaults in `api.py`
(block_s, programs per SM for 132 SMs, load stages, pv_transposed) from H200 sweeps. A Blackwell
run should check first the tests' tolerances on the device, then re-sweep block_s, k_splits (148
SMs on a B200) and num_stages. The TPU lowering is `mosaic.py` (Mosaic), FP4 only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import common
from kernels_pallas.common import load_rows, online_softmax_step
from trace_jax.fp4 import BlockFormat, PackedTensorCache

# Smallest query tile: Triton's dot needs M >= 16.
MIN_BLOCK_G = 16
# Float32 dots in full precision (Triton: IEEE, where DEFAULT would mean TF32); bf16 dots are
# unaffected (plain bf16 tensor-core MMA with float32 accumulation).
_PRECISION = jax.lax.Precision.HIGHEST
DECODES = ("f16", "e4m3")
DEFAULT_DECODE = "f16"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Static tiling of one call.

    Attributes:
      block_s: slots per step of the in-kernel loop (a power of two, >= 16).
      chunk: slots per split, a multiple of block_s; k_splits = ceil(S / chunk).
      block_g: query-tile rows, the G heads of a kv head zero-padded (power of two, >= G).
      num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
      decode: how FP4 rows become dot operands (ignored for a bf16 cache): "f16" (word-level
        PTX to float16, float16 dots) or "e4m3" (bytes to FP8, hardware FP8 -> bf16, bf16 dots).
      pv_transposed: accumulate the output transposed, acc^T [Dh, block_g] += V^T . p^T, so the
        decoded V rows are the dot's first operand and the block_g query rows (8 for a group of
        8, below the 16-row MMA tile) its N dimension. The same sums in another operand order.
        On the H200 3-11% faster with head_dim 128, 2.3-2.7x slower with head_dim 64; the api
        turns it on from head_dim 128.
    """

    block_s: int
    chunk: int
    block_g: int
    num_warps: int = 4
    num_stages: int = 2
    decode: str = DEFAULT_DECODE
    pv_transposed: bool = False

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"block_s must be a power of two >= 16, got {self.block_s}")
        if self.chunk <= 0 or self.chunk % self.block_s:
            raise ValueError(
                f"chunk must be a positive multiple of block_s={self.block_s}, got {self.chunk}"
            )
        if self.block_g <= 0 or self.block_g & (self.block_g - 1):
            raise ValueError(f"block_g must be a power of two, got {self.block_g}")
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")

    def k_splits(self, slots: int) -> int:
        return pl.cdiv(slots, self.chunk)


def block_g_for(group: int) -> int:
    """Query-tile rows for G query heads per kv head."""
    return max(MIN_BLOCK_G, pl.next_power_of_2(group))


def dot_dtype_for(q_dtype) -> jnp.dtype:
    """The dot's input dtype: bf16 for a bf16 query (tensor cores), else float32."""
    return jnp.dtype(jnp.bfloat16) if q_dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Kernel body.


def decode_fp4_planes(
    codes: jax.Array, bits: jax.Array, fmt: BlockFormat, dtype
) -> tuple[jax.Array, jax.Array]:
    """Even and odd elements of packed rows, each `code * block_scale * 2**-6` in `dtype`.

    codes uint8 [rows, Dh/2] and scale bits uint8 [rows, Dh/block] -> two [rows, Dh/2] arrays
    (element 2i of a row is column i of the first, 2i + 1 of the second), inside or outside a
    kernel. No interleave: the kernel contracts them with the query's even and odd halves. The
    2**-6 (`common.E4M3_ALIGN`) comes from the FP8 decode and is undone once after the dots.
    `code * scale * 2**-6` is exact in bf16 (at most 6 significant bits) unless it underflows
    (E8M0 scales below about 2**-118).
    """
    rows, half = codes.shape
    nb = bits.shape[1]
    scales = common.decode_scale_bits(bits, fmt).astype(dtype)[:, :, None]  # [rows, NB, 1]
    planes = []
    for plane in common.fp4_planes_as_e4m3(codes):
        values = plane.astype(dtype).reshape(rows, nb, half // nb)
        planes.append((values * scales).reshape(rows, half))
    return planes[0], planes[1]


def decode_fp4_planes_f16(
    codes: jax.Array,
    bits: jax.Array,
    global_scale: jax.Array | None,
    fmt: BlockFormat,
    dtype,
    *,
    inline_asm: bool,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Even and odd elements of packed rows as float16 dot operands, plus a float32 row factor.

    codes uint8 [rows, NB, block/2] (one scale block per middle index), bits uint8 [rows, NB],
    NVFP4's global scale float32 [rows] or None -> ((even, odd) [rows, Dh/2] in `dtype`, row
    factor float32 [rows]). Element values are `code * elem_scale * 2**-14`
    (`common.fp4_planes_as_f16`, `common.split_block_scales`); the true value is that times the
    row factor times 2**14. The codes arrive already split by scale block, so the scales broadcast
    over the last axis without a register reshape; the one reshape merges contiguous axes.
    """
    rows, nb, per_block = codes.shape
    elem, row = common.split_block_scales(bits, fmt, global_scale)
    elem = elem[:, :, None]
    planes = tuple(
        (plane * elem).astype(dtype).reshape(rows, nb * per_block)
        for plane in common.fp4_planes_as_f16(codes, inline_asm=inline_asm)
    )
    return planes, row


# load_kv(kv_refs, start, valid) -> (k planes, k_row_scale [block_s] | None, v planes, v_scale):
# each planes entry a tuple of [block_s, Dh / n_planes] arrays matching the query planes.
LoadKV = Callable[[Sequence, jax.Array, jax.Array], tuple]


def block_scores(qs, ks, k_scale, valid, q_scale) -> jax.Array:
    """Scores [block_g, block_s] float32 of one block: the planes' q . k, K's row factors, the
    query rows' scales; -inf where the slot is not `valid`."""
    s = sum(
        jnp.dot(q, k.T, precision=_PRECISION, preferred_element_type=jnp.float32)
        for q, k in zip(qs, ks, strict=True)
    )
    if k_scale is not None:
        s = s * k_scale[None, :]
    return jnp.where(valid[None, :], s * q_scale, -jnp.inf)


def weight_by_v_rows(p, v_scale, dtype):
    """p times V's row factors (none: unchanged), in `dtype` for the p . v dot, and the factor
    taken out to be put back on the dot's result."""
    pv_scale = 1.0
    if v_scale is not None:
        # Divided by the block's largest row factor the weights stay in [0, 1], so a float16 p
        # neither overflows nor loses range.
        pv_scale = jnp.maximum(v_scale.max(), jnp.finfo(jnp.float32).tiny)
        p = p * (v_scale / pv_scale)[None, :]
    return p.astype(dtype), pv_scale


def _flash_decode_kernel(
    len_ref,
    q_scale_ref,
    *refs,
    load_kv: LoadKV,
    n_planes: int,
    n_kv_refs: int,
    block_s: int,
    chunk: int,
    v_factor: float,
    pv_transposed: bool = False,
):
    """One (b, h, split): online softmax over the split's blocks; writes (acc planes, m, l).

    q_scale_ref [block_g] float32 scales each query row's scores (the softmax scale times the
    factor the query was normalized by, see `flash_decode`). `pv_transposed`:
    `BlockConfig.pv_transposed`.
    """
    q_refs, kv_refs = refs[:n_planes], refs[n_planes : n_planes + n_kv_refs]
    acc_refs, (m_ref, sum_ref) = refs[n_planes + n_kv_refs : -2], refs[-2:]
    length = len_ref[()]
    chunk_start = pl.program_id(2) * chunk  # grid (batch, kv head, split)
    # Blocks holding at least one valid slot; each such block has a finite score.
    n_blocks = jnp.clip(pl.cdiv(length - chunk_start, block_s), 0, chunk // block_s)
    qs = [r[...] for r in q_refs]  # [block_g, Dh / n_planes] each, already in the dot dtype
    q_scale = q_scale_ref[...][:, None]
    block_g = qs[0].shape[0]

    def body(i, carry):
        m, total, accs = carry  # running max, running sum of exp, accumulator planes
        start = chunk_start + i * block_s
        valid = start + jnp.arange(block_s, dtype=jnp.int32) < length  # [block_s]
        ks, k_scale, vs, v_scale = load_kv(kv_refs, start, valid)
        s = block_scores(qs, ks, k_scale, valid, q_scale)
        m_new, alpha, p, total = online_softmax_step(m, total, s)
        p, pv_scale = weight_by_v_rows(p, v_scale, vs[0].dtype)
        if pv_transposed:  # acc^T [Dh / n_planes, block_g]
            accs = tuple(
                alpha[None, :] * acc
                + pv_scale
                * jnp.dot(v.T, p.T, precision=_PRECISION, preferred_element_type=jnp.float32)
                for acc, v in zip(accs, vs, strict=True)
            )
        else:
            accs = tuple(
                alpha[:, None] * acc
                + pv_scale * jnp.dot(p, v, precision=_PRECISION, preferred_element_type=jnp.float32)
                for acc, v in zip(accs, vs, strict=True)
            )
        return m_new, total, accs

    acc_shape = (lambda r, c: (c, r)) if pv_transposed else (lambda r, c: (r, c))
    init = (
        jnp.full((block_g,), -jnp.inf, jnp.float32),
        jnp.zeros((block_g,), jnp.float32),
        tuple(jnp.zeros(acc_shape(*q.shape), jnp.float32) for q in qs),
    )
    m, total, accs = jax.lax.fori_loop(0, n_blocks, body, init)
    for acc_ref, acc in zip(acc_refs, accs, strict=True):
        acc_ref[...] = (acc.T if pv_transposed else acc) * v_factor
    m_ref[...] = m
    sum_ref[...] = total


def _kv_pair_loader(fmt: BlockFormat, load_one) -> LoadKV:
    """LoadKV over refs (codes, scale bits[, global scale]) for K then V, each by `load_one`."""

    def load_kv(refs, start, valid):
        if fmt.has_global_scale:
            kc, ks, kg, vc, vs, vg = refs
        else:
            (kc, ks, vc, vs), kg, vg = refs, None, None
        return (*load_one(kc, ks, kg, start, valid), *load_one(vc, vs, vg, start, valid))

    return load_kv


def _fp4_load_kv(fmt: BlockFormat, block_s: int, dot_dtype) -> LoadKV:
    def load_one(codes_ref, bits_ref, global_ref, start, valid):
        codes = load_rows(codes_ref, start, block_s, valid)
        bits = load_rows(bits_ref, start, block_s, valid)
        planes = decode_fp4_planes(codes, bits, fmt, dot_dtype)
        row_scale = None if global_ref is None else load_rows(global_ref, start, block_s, valid)
        return planes, row_scale

    return _kv_pair_loader(fmt, load_one)


def _fp4_f16_load_kv(fmt: BlockFormat, block_s: int, dot_dtype, inline_asm: bool) -> LoadKV:
    """Like `_fp4_load_kv` over codes split by scale block ([S, NB, block/2] per (b, h))."""

    def load_one(codes_ref, bits_ref, global_ref, start, valid):
        codes = load_rows(codes_ref, start, block_s, valid)
        bits = load_rows(bits_ref, start, block_s, valid)
        glob = None if global_ref is None else load_rows(global_ref, start, block_s, valid)
        return decode_fp4_planes_f16(codes, bits, glob, fmt, dot_dtype, inline_asm=inline_asm)

    return _kv_pair_loader(fmt, load_one)


def _bf16_load_kv(block_s: int, dot_dtype) -> LoadKV:
    def load_kv(refs, start, valid):
        k_ref, v_ref = refs
        k = load_rows(k_ref, start, block_s, valid).astype(dot_dtype)
        v = load_rows(v_ref, start, block_s, valid).astype(dot_dtype)
        return (k,), None, (v,), None

    return load_kv


# ---------------------------------------------------------------------------------------------
# pallas_call and the split combine.


def flash_decode(
    q: jax.Array,
    kv_arrays: Sequence[jax.Array],
    lengths: jax.Array,
    load_kv: LoadKV,
    *,
    n_planes: int,
    value_factor: float,
    dot_dtype,
    normalize_q: bool,
    config: BlockConfig,
    interpret: bool,
    name: str,
    body: Callable | None = None,
    head_major: bool = False,
) -> jax.Array:
    """q [B, H, Dh]; each kv array [B, S, Hkv, ...] (rows per slot and kv head) -> [B, H, Dh].

    `body`: the kernel body (default `_flash_decode_kernel`; the decode-attention ablation in
    `experiments/` passes cut-down bodies with the same refs to time the kernel's parts).
    `head_major`: the kv arrays are [B, Hkv, S, ...] instead, so that one program's rows are
    contiguous (the packed FP4 cache is stored so; the bf16 twin reads the model's slot-major
    bf16 cache, and the ablation times a slot-major copy of the FP4 cache to see what the layout
    gains). The kernel body sees the same [S, ...] refs either way.

    With `n_planes` = 2 the kernel sees the head dim as even and odd planes (FP4 rows decode that
    way without an interleave); the output planes are interleaved back here. K and V values come
    out of `load_kv` scaled by `value_factor`, undone on the scores and on the output. With
    `normalize_q` each query row is divided by a power of two at least its largest |value| (exact)
    so that a float16 query cannot overflow; the factor goes back onto that row's scores.
    """
    b, h, dh = q.shape
    s, hkv = kv_arrays[0].shape[1:3]
    if head_major:
        hkv, s = s, hkv
    g = h // hkv
    bg = config.block_g
    k_splits = config.k_splits(s)
    dp = dh // n_planes

    qg = q.reshape(b, hkv, g, dp, n_planes).astype(jnp.float32)
    q_scale = jnp.full((b, hkv, g), dh**-0.5 / value_factor, jnp.float32)
    if normalize_q:
        _, exponent = jnp.frexp(jnp.abs(qg).max(axis=(3, 4)))  # max |q| < 2**exponent
        qg = qg * jnp.ldexp(1.0, -exponent)[..., None, None]
        q_scale = q_scale * jnp.ldexp(1.0, exponent)
    qg = jnp.pad(qg.astype(dot_dtype), ((0, 0), (0, 0), (0, bg - g), (0, 0), (0, 0)))
    q_scale = jnp.pad(q_scale, ((0, 0), (0, 0), (0, bg - g)))
    q_planes = [qg[..., i] for i in range(n_planes)]
    lengths = jnp.minimum(lengths.astype(jnp.int32), s)

    sq = pl.squeezed

    def kv_spec(a):
        rest, zeros = a.shape[3:], (0,) * (a.ndim - 3)
        if head_major:
            return pl.BlockSpec((sq, sq, s, *rest), lambda i, j, _: (i, j, 0, *zeros))
        return pl.BlockSpec((sq, s, sq, *rest), lambda i, j, _: (i, 0, j, *zeros))

    production = functools.partial(_flash_decode_kernel, pv_transposed=config.pv_transposed)
    kernel = functools.partial(
        body or production,
        load_kv=load_kv,
        n_planes=n_planes,
        n_kv_refs=len(kv_arrays),
        block_s=config.block_s,
        chunk=config.chunk,
        v_factor=1.0 / value_factor,
    )
    acc_spec = pl.BlockSpec((sq, sq, sq, bg, dp), lambda i, j, t: (i, j, t, 0, 0))
    stat_spec = pl.BlockSpec((sq, sq, sq, bg), lambda i, j, t: (i, j, t, 0))
    acc_shape = jax.ShapeDtypeStruct((b, hkv, k_splits, bg, dp), jnp.float32)
    stat_shape = jax.ShapeDtypeStruct((b, hkv, k_splits, bg), jnp.float32)
    *accs, m, total = pl.pallas_call(
        kernel,
        grid=(b, hkv, k_splits),
        in_specs=[
            pl.BlockSpec((sq,), lambda i, j, t: (i,)),
            pl.BlockSpec((sq, sq, bg), lambda i, j, t: (i, j, 0)),
            *(pl.BlockSpec((sq, sq, bg, dp), lambda i, j, t: (i, j, 0, 0)) for _ in q_planes),
            *(kv_spec(a) for a in kv_arrays),
        ],
        out_specs=[*(acc_spec for _ in q_planes), stat_spec, stat_spec],
        out_shape=[*(acc_shape for _ in q_planes), stat_shape, stat_shape],
        compiler_params=common.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name=name,
    )(lengths, q_scale, *q_planes, *kv_arrays)
    acc = jnp.stack(accs, axis=-1).reshape(b, hkv, k_splits, bg, dh)  # planes interleaved back
    out = combine_partials(acc, m, total)  # [B, Hkv, block_g, Dh]
    return out[:, :, :g].reshape(b, h, dh).astype(q.dtype)


def combine_partials(acc: jax.Array, m: jax.Array, total: jax.Array) -> jax.Array:
    """Merges split partials by log-sum-exp.

    Args:
      acc: [..., K, G, Dh] sum over the split of exp(s - m) * v.
      m, total: [..., K, G] the split's max score and sum of exp(s - m).

    A split with no valid slot has m = -inf, total = 0, acc = 0 and weight 0; split 0 always holds
    slot 0, so the max is finite whenever lengths >= 1. Returns [..., G, Dh] float32.
    """
    m_max = m.max(axis=-2, keepdims=True)
    w = jnp.exp(m - m_max)
    denom = (w * total).sum(axis=-2)
    return (w[..., None] * acc).sum(axis=-3) / denom[..., None]


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp4_decode_attention_pallas(
    q: jax.Array,
    k_cache: PackedTensorCache,
    v_cache: PackedTensorCache,
    lengths: jax.Array,
    *,
    config: BlockConfig,
    interpret: bool,
) -> jax.Array:
    """Decode attention reading the packed FP4 cache in the kernel (inputs checked by the api)."""
    return flash_decode(
        q,
        lengths=lengths,
        config=config,
        interpret=interpret,
        name="fp4_decode_attn",
        **fp4_kernel_inputs(q.dtype, k_cache, v_cache, config, interpret),
    )


def fp4_kernel_inputs(
    q_dtype, k_cache: PackedTensorCache, v_cache: PackedTensorCache, config: BlockConfig, interpret
) -> dict:
    """`flash_decode`'s cache arguments for a packed FP4 cache: the kv arrays (codes split by
    scale block for the "f16" decode, scale bits, NVFP4 global scales), their loader and the
    dot settings."""
    fmt = k_cache.fmt
    f16 = config.decode == "f16"
    arrays = []
    for cache in (k_cache, v_cache):  # head-major arrays [B, Hkv, S, ...]
        codes = cache.codes
        if f16:  # [B, Hkv, S, NB, block / 2]: split by scale block (a free reshape)
            codes = codes.reshape(*codes.shape[:3], -1, fmt.block_size // 2)
        arrays += [codes, common.scale_bits(cache.scales)]
        if fmt.has_global_scale:
            arrays.append(cache.global_scale[..., 0].astype(jnp.float32))  # [B, Hkv, S]
    if f16:
        dot_dtype = jnp.float16 if q_dtype == jnp.bfloat16 else jnp.float32
        load_kv = _fp4_f16_load_kv(fmt, config.block_s, dot_dtype, inline_asm=not interpret)
    else:
        dot_dtype = dot_dtype_for(q_dtype)
        load_kv = _fp4_load_kv(fmt, config.block_s, dot_dtype)
    return dict(
        kv_arrays=arrays,
        head_major=True,
        load_kv=load_kv,
        n_planes=2,
        value_factor=common.F16_ALIGN if f16 else common.E4M3_ALIGN,
        dot_dtype=dot_dtype,
        normalize_q=f16,
    )


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def bf16_decode_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    config: BlockConfig,
    interpret: bool,
) -> jax.Array:
    """The same kernel over a bf16 cache k, v [B, S, Hkv, Dh] (inputs checked by the api)."""
    dot_dtype = dot_dtype_for(q.dtype)
    load_kv = _bf16_load_kv(config.block_s, dot_dtype)
    return flash_decode(
        q,
        [k, v],
        lengths,
        load_kv,
        n_planes=1,
        value_factor=1.0,
        dot_dtype=dot_dtype,
        normalize_q=False,
        config=config,
        interpret=interpret,
        name="bf16_decode_attn",
    )
