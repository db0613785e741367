"""Mosaic (TPU) flash-decoding of one new query token per sequence over a packed FP4 KV cache.

The contract of `kernel.fp4_decode_attention_pallas` and the api's `fp4_decode_attention`: q
[B, H, Dh] bf16 or float32, a pair of head-major `PackedTensorCache`s (NVFP4 or MXFP4) of logical
shape [B, S, Hkv, Dh], lengths int [B] (slots < lengths[b] attended, values above S count as S,
0 gives NaN) -> [B, H, Dh] in q.dtype.

Axis legend: B batch, H query heads, Hkv kv heads, G = H // Hkv (query head h reads kv head
h // G), Gp = G padded to whole sublane tiles, S cache slots, Dh head dim, NB = Dh / block.

Structure. Grid (B, Hkv, k_splits, blocks_per_split): the K/V blocks of `block_s` slots are
BlockSpec-pipelined over the last, "arbitrary" axis (the next block's DMA overlaps this block's
compute) and an online softmax (running max m, sum l, accumulators, float32) accumulates across
it in VMEM scratch; each split writes its partial (acc, m, l) at its last block and
`kernel.combine_partials` merges the splits by log-sum-exp after the call. Both, because a
TensorCore runs its grid points in sequence: the sequential axis costs nothing and needs no
partials, while the "parallel" split axis lets a chip's TensorCores (two on megacore chips) share
a sequence when B * Hkv alone cannot keep them busy (`default_k_splits`). The G query heads of
one kv head form one program's query tile (one K/V read serves all G; zero rows pad it to Gp).

Lengths arrive by scalar prefetch (SMEM). The K/V index map clamps the block index to the last
block holding a valid slot, so blocks past lengths[b] repeat the previous block index (the
pipeline skips that copy) and `pl.when` skips their compute. Inside a block, slots >= lengths[b]
(stale data, or the unspecified padding of the edge block when S is not a multiple of block_s)
get score -inf and their V rows and V row factors are zeroed by selects: a stale NaN never
reaches the output through a zero probability.

What differs from the Triton lowering (`kernel.py`) and why:
  * Tiles: the cache arrays keep their head-major layout and the blocks take full last dims
    (codes [block_s, Dh/2] uint8, scale bits [block_s, NB] uint8), legal for Mosaic because they
    equal the array dims. NVFP4's global scale is viewed as [B, Hkv, 1, S] (a free reshape) so
    that a block is a [1, block_s] lane vector, the layout of the scores it multiplies; hence
    block_s is a multiple of 128 lanes (or all of S).
  * Decode: float32 VPU arithmetic from `trace_jax.fp4` (`common.unpack_nibbles`,
    `common.decode_e2m1`, `common.decode_scale_bits`: int32 shifts, masks, selects and exponent
    bit fields, exact), after widening the uint8 bytes to int32. No FP8 or float16 bit tricks
    (no PTX; FP8 is not on every TPU generation). A block scale reaches its Dh/2 plane columns
    by NB - 1 lane selects (`expand_block_scales`), because a lane repeat is not a Mosaic op.
  * Planes: like the Triton kernel, the even and odd elements (low and high nibbles) stay two
    [block_s, Dh/2] planes, contracted with the query's even and odd halves (split outside), and
    the two output planes are interleaved after the call, so no lane interleave happens in VMEM.
  * Dots: a bf16 query runs bf16 x bf16 MXU dots with float32 accumulation (code * block scale
    is exact in bf16: at most 6 significant bits, float32's exponent range); a float32 query runs
    float32 dots at Precision.HIGHEST. NVFP4's global scale multiplies the scores (K) and the
    probabilities (V) as a row factor, in float32, as in the Triton kernel; no query
    normalization is needed (bf16 has float32's range).
  * Softmax: an exact division by the summed weights in the combine (float32), as in Triton.

What a first real TPU run should check. Mosaic's layout passes run only in the TPU compiler (a
CPU lowering stops at the serialized kernel), so first that it compiles: the uint8 -> int32
widening, the 64-lane planes and their dots with a 64-long contraction, the [Gp, 1] softmax
statistics. Then that `block_s` = DEFAULT_BLOCK_S is near the best (each grid step has a fixed
pipeline overhead; sweep 256-2048); the VMEM and HBM padding of the
lane-sparse arrays (Dh/2 = 64 code bytes and NB scale bytes per row pad to 128 lanes: a
lane-dense view, several slots per 128-byte row, would halve the code DMA); whether the VPU
decode (about 15 int32/float32 ops per element, plus the NB - 1 scale selects) or the DMA
bounds the step; and that "parallel" split and head axes are spread over both TensorCores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import common
from kernels_pallas.fp4_decode_attention.kernel import combine_partials
from trace_jax.fp4 import BlockFormat, PackedTensorCache

# The lane width of a TPU vector register: slots are the lane axis of scores and of the global
# scale rows, so blocks of slots are whole multiples of it.
LANES = 128
# Slots per grid step: each step carries a fixed pipeline overhead, and 512 slots of packed K and
# V (about 38 KB for Dh = 128) stay far below VMEM while amortizing it (not tuned on a TPU).
DEFAULT_BLOCK_S = 512
# TensorCores per chip on megacore TPUs: "parallel" grid axes are split across them.
TENSORCORES_PER_CHIP = 2
_Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """Static tiling of one call.

    Attributes:
      block_s: slots per grid step (a multiple of LANES, or S when S fits one block).
      blocks_per_split: grid steps of one split (the "arbitrary" axis).
      k_splits: splits of the S slots (a "parallel" axis); none is empty.
    """

    block_s: int
    blocks_per_split: int
    k_splits: int


def default_k_splits(batch: int, kv_heads: int) -> int:
    """Splits so that B * Hkv * k_splits fills a chip's TensorCores; one when B * Hkv does."""
    return pl.cdiv(TENSORCORES_PER_CHIP, batch * kv_heads)


def mosaic_tiling(
    batch: int, slots: int, kv_heads: int, block_s: int | None, k_splits: int | None
) -> MosaicTiling:
    """The tiling of `fp4_decode_attention_mosaic` for a [B, S, Hkv, Dh] cache (checks the
    options: block_s a positive multiple of LANES, k_splits a positive int)."""
    block_s = DEFAULT_BLOCK_S if block_s is None else block_s
    if not isinstance(block_s, int) or block_s < LANES or block_s % LANES:
        raise ValueError(f"block_s must be a positive multiple of {LANES} (lanes), got {block_s!r}")
    k_splits = default_k_splits(batch, kv_heads) if k_splits is None else k_splits
    if not isinstance(k_splits, int) or k_splits < 1:
        raise ValueError(f"k_splits must be a positive int, got {k_splits!r}")
    if slots < 1:
        raise ValueError("the cache has no slots (S = 0)")
    block_s = min(block_s, slots)  # one full-S block: legal for any S
    n_blocks = pl.cdiv(slots, block_s)
    per_split = pl.cdiv(n_blocks, min(k_splits, n_blocks))
    return MosaicTiling(block_s, per_split, pl.cdiv(n_blocks, per_split))


def check_inputs(
    q: jax.Array, k_cache: PackedTensorCache, v_cache: PackedTensorCache, lengths: jax.Array
) -> None:
    """Raises ValueError naming the first argument that breaks the op's contract."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, PackedTensorCache):
            raise ValueError(f"{name} must be a PackedTensorCache, got {type(cache).__name__}")
        if not cache.fmt.is_fp4:
            raise ValueError(f"{name} must hold an FP4 format, got {cache.fmt.name}")
        if cache.codes.ndim != 4 or cache.codes.dtype != jnp.uint8:
            raise ValueError(
                f"{name}.codes must be uint8 [B, Hkv, S, Dh // 2], got {cache.codes.dtype} "
                f"{cache.codes.shape}"
            )
        rows, fmt = cache.codes.shape[:3], cache.fmt
        nb = 2 * cache.codes.shape[3] // fmt.block_size
        if cache.scales.shape != (*rows, nb) or cache.scales.dtype != fmt.scale_dtype:
            raise ValueError(
                f"{name}.scales must be {fmt.scale_dtype} {(*rows, nb)} for {fmt.name}, got "
                f"{cache.scales.dtype} {cache.scales.shape}"
            )
        glob = None if cache.global_scale is None else cache.global_scale.shape
        if fmt.has_global_scale and glob != (*rows, 1):
            raise ValueError(
                f"{name}.global_scale must be [B, Hkv, S, 1] = {(*rows, 1)}, got {glob}"
            )
    if k_cache.fmt != v_cache.fmt or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache ({k_cache.fmt.name} {k_cache.shape}) and v_cache ({v_cache.fmt.name} "
            f"{v_cache.shape}) must have the same format and shape"
        )
    batch, _, kv_heads, head_dim = k_cache.shape
    if q.ndim != 3 or q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be bfloat16 or float32 [B, H, Dh], got {q.dtype} {q.shape}")
    if (q.shape[0], q.shape[2]) != (batch, head_dim) or q.shape[1] % kv_heads:
        raise ValueError(
            f"q must be [B, H, Dh] with B = {batch}, Dh = {head_dim} and H a multiple of the "
            f"cache's {kv_heads} kv heads, got {q.shape}"
        )
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be int [{batch}], got {lengths.dtype} {lengths.shape}")


def expand_block_scales(scales: jax.Array, lanes_per_block: int) -> jax.Array:
    """Block scales [rows, NB] -> [rows, NB * lanes_per_block]: each scale repeated over its
    block's lanes, by NB - 1 selects on a lane iota (a lane repeat does not lower in Mosaic;
    a select, unlike a product with a 0/1 matrix, keeps a NaN scale inside its block)."""
    rows, nb = scales.shape
    shape = (rows, nb * lanes_per_block)
    # lax.div truncates (a floor division would lower through `sign`, not a Mosaic op).
    block = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, 1), lanes_per_block)
    out = jnp.broadcast_to(scales[:, :1], shape)
    for j in range(1, nb):
        out = jnp.where(block == j, jnp.broadcast_to(scales[:, j : j + 1], shape), out)
    return out


def decode_fp4_planes(
    codes: jax.Array, bits: jax.Array, fmt: BlockFormat, dtype
) -> tuple[jax.Array, jax.Array]:
    """Even and odd elements of packed rows, `code * block_scale` in `dtype`, inside a Mosaic
    kernel or outside.

    codes uint8 [rows, Dh/2], scale bits uint8 [rows, NB] -> two [rows, Dh/2] (element 2i of a
    row is column i of the first, 2i + 1 of the second; both columns lie in scale block
    i // (block / 2)). float32 arithmetic of `trace_jax.fp4` on int32-widened bytes: exact, and
    exact in bf16 too (at most 6 significant bits) unless below float32's normal range.
    """
    low, high = common.unpack_nibbles(codes.astype(jnp.int32))
    scales = common.decode_scale_bits(bits.astype(jnp.int32), fmt)
    elem_scale = expand_block_scales(scales, fmt.block_size // 2)
    return tuple((common.decode_e2m1(c) * elem_scale).astype(dtype) for c in (low, high))


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [N, K]^T -> [M, N] float32 (float32 operands at full precision)."""
    return jax.lax.dot_general(
        a,
        b,
        (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [K, N] -> [M, N] float32 (float32 operands at full precision)."""
    return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _flash_decode_kernel(
    lengths_ref,
    q_even_ref,
    q_odd_ref,
    *refs,
    fmt: BlockFormat,
    block_s: int,
    blocks_per_split: int,
    softmax_scale: float,
):
    """One (b, h, split, step): decodes a K/V block, folds it into the online softmax in VMEM
    scratch, and at the split's last step writes its partial (acc planes, m, l)."""
    n_kv = 3 if fmt.has_global_scale else 2
    k_refs, v_refs = refs[:n_kv], refs[n_kv : 2 * n_kv]
    out_even, out_odd, m_out, l_out = refs[2 * n_kv : 2 * n_kv + 4]
    acc_even, acc_odd, m_ref, l_ref = refs[2 * n_kv + 4 :]
    step = pl.program_id(3)
    length = lengths_ref[pl.program_id(0)]
    start = (pl.program_id(2) * blocks_per_split + step) * block_s

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_even[...] = jnp.zeros(acc_even.shape, jnp.float32)
        acc_odd[...] = jnp.zeros(acc_odd.shape, jnp.float32)

    @pl.when(start < length)  # at least one valid slot, so a finite score
    def _accumulate():
        dtype = q_even_ref.dtype
        slot_lanes = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        slot_rows = start + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
        valid_lanes, valid_rows = slot_lanes < length, slot_rows < length
        k_even, k_odd = decode_fp4_planes(k_refs[0][...], k_refs[1][...], fmt, dtype)
        s = _dot_nt(q_even_ref[...], k_even) + _dot_nt(q_odd_ref[...], k_odd)  # [Gp, block_s]
        s = s * softmax_scale
        if fmt.has_global_scale:
            s = s * k_refs[2][...]  # [1, block_s] row factors
        s = jnp.where(valid_lanes, s, -jnp.inf)
        m_prev = m_ref[...]  # [Gp, 1]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        m_ref[...] = m_new
        if fmt.has_global_scale:
            p = p * jnp.where(valid_lanes, v_refs[2][...], 0.0)
        p = p.astype(dtype)
        v_even, v_odd = decode_fp4_planes(v_refs[0][...], v_refs[1][...], fmt, dtype)
        for acc, v in ((acc_even, v_even), (acc_odd, v_odd)):
            v = jnp.where(valid_rows, v, jnp.zeros((), dtype))
            acc[...] = alpha * acc[...] + _dot(p, v)

    @pl.when(step == blocks_per_split - 1)
    def _write_partial():
        out_even[...] = acc_even[...]
        out_odd[...] = acc_odd[...]
        m_out[...] = m_ref[...]
        l_out[...] = l_ref[...]


def _sublane_tile(dtype) -> int:
    """Rows of one (sublane, 128) vreg tile for `dtype`: 8 for float32, 16 for bf16."""
    return 32 // jnp.dtype(dtype).itemsize


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def _fp4_decode_attention_mosaic(
    q: jax.Array,
    k_cache: PackedTensorCache,
    v_cache: PackedTensorCache,
    lengths: jax.Array,
    *,
    tiling: MosaicTiling,
    interpret: pltpu.InterpretParams | None,
) -> jax.Array:
    fmt = k_cache.fmt
    b, h, dh = q.shape
    _, s, hkv, _ = k_cache.shape
    g = h // hkv
    gp = pl.cdiv(g, _sublane_tile(q.dtype)) * _sublane_tile(q.dtype)
    half = dh // 2
    block_s, per_split, k_splits = tiling.block_s, tiling.blocks_per_split, tiling.k_splits

    qg = jnp.pad(q.reshape(b, hkv, g, half, 2), ((0, 0), (0, 0), (0, gp - g), (0, 0), (0, 0)))
    q_planes = [qg[..., 0], qg[..., 1]]  # even and odd elements [B, Hkv, Gp, Dh/2]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)

    kv_arrays = []
    for cache in (k_cache, v_cache):  # head-major [B, Hkv, S, ...]
        kv_arrays += [cache.codes, common.scale_bits(cache.scales)]
        if fmt.has_global_scale:  # [B, Hkv, S, 1] -> [B, Hkv, 1, S]: slots on lanes
            kv_arrays.append(cache.global_scale.astype(jnp.float32).reshape(b, hkv, 1, s))

    def kv_block(i, j, t, step, lengths_ref):
        """Block index of split t's step: clamped to the last block holding a valid slot."""
        last = jnp.maximum(jax.lax.div(lengths_ref[i] + block_s - 1, block_s) - 1, 0)
        return jnp.minimum(t * per_split + step, last)

    sq = pl.squeezed

    def kv_spec(a):
        if a.shape[2] == 1:  # global scales [B, Hkv, 1, S]
            return pl.BlockSpec(
                (sq, sq, 1, block_s), lambda i, j, t, st, n: (i, j, 0, kv_block(i, j, t, st, n))
            )
        return pl.BlockSpec(
            (sq, sq, block_s, a.shape[3]),
            lambda i, j, t, st, n: (i, j, kv_block(i, j, t, st, n), 0),
        )

    q_spec = pl.BlockSpec((sq, sq, gp, half), lambda i, j, t, st, n: (i, j, 0, 0))
    acc_spec = pl.BlockSpec((sq, sq, sq, gp, half), lambda i, j, t, st, n: (i, j, t, 0, 0))
    stat_spec = pl.BlockSpec((sq, sq, sq, gp, 1), lambda i, j, t, st, n: (i, j, t, 0, 0))
    acc_shape = jax.ShapeDtypeStruct((b, hkv, k_splits, gp, half), jnp.float32)
    stat_shape = jax.ShapeDtypeStruct((b, hkv, k_splits, gp, 1), jnp.float32)
    kernel = functools.partial(
        _flash_decode_kernel,
        fmt=fmt,
        block_s=block_s,
        blocks_per_split=per_split,
        softmax_scale=dh**-0.5,
    )
    acc_even, acc_odd, m, total = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, k_splits, per_split),
            in_specs=[q_spec, q_spec, *(kv_spec(a) for a in kv_arrays)],
            out_specs=[acc_spec, acc_spec, stat_spec, stat_spec],
            scratch_shapes=[
                pltpu.VMEM((gp, half), jnp.float32),
                pltpu.VMEM((gp, half), jnp.float32),
                pltpu.VMEM((gp, 1), jnp.float32),
                pltpu.VMEM((gp, 1), jnp.float32),
            ],
        ),
        out_shape=[acc_shape, acc_shape, stat_shape, stat_shape],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=False if interpret is None else interpret,
        name="fp4_decode_attn_mosaic",
    )(lengths, *q_planes, *kv_arrays)
    acc = jnp.stack([acc_even, acc_odd], axis=-1).reshape(b, hkv, k_splits, gp, dh)
    out = combine_partials(acc, m[..., 0], total[..., 0])  # [B, Hkv, Gp, Dh]
    return out[:, :, :g].reshape(b, h, dh).astype(q.dtype)


def fp4_decode_attention_mosaic(
    q: jax.Array,
    k_cache: PackedTensorCache,
    v_cache: PackedTensorCache,
    lengths: jax.Array,
    *,
    block_s: int | None = None,
    k_splits: int | None = None,
    interpret: pltpu.InterpretParams | None = None,
) -> jax.Array:
    """Attention of one new query token per sequence over a packed FP4 KV cache, on a TPU.

    Args:
      q: [B, H, Dh] bfloat16 or float32; query head h reads kv head h // (H // Hkv).
      k_cache, v_cache: `PackedTensorCache`s of one format (NVFP4 or MXFP4), [B, S, Hkv, Dh].
      lengths: int [B]; slots < lengths[b] are attended (at least 1; 0 gives NaN). Values above S
        count as S.
      block_s: slots per grid step, a positive multiple of LANES (default DEFAULT_BLOCK_S; a
        cache of at most block_s slots is one block).
      k_splits: splits of the S slots (default `default_k_splits`); the effective number is
        `mosaic_tiling(...).k_splits` (no split is left empty).
      interpret: None compiles for a TPU; `pltpu.InterpretParams()` runs the kernel with TPU
        semantics on the CPU.

    Returns:
      [B, H, Dh] in q.dtype: softmax(q k^T * Dh**-0.5) v over the valid slots.
    """
    lengths = jnp.asarray(lengths)
    check_inputs(q, k_cache, v_cache, lengths)
    batch, slots, kv_heads, _ = k_cache.shape
    tiling = mosaic_tiling(batch, slots, kv_heads, block_s, k_splits)
    return _fp4_decode_attention_mosaic(
        q, k_cache, v_cache, lengths, tiling=tiling, interpret=interpret
    )
