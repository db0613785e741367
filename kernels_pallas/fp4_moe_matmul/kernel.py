"""Pallas grouped matmul with packed FP4 weights, decoded in-kernel (Triton lowering on a GPU).

Axis legend: M rows of lhs (sorted by group), K contraction, N outputs, G groups (experts);
T = cdiv(M, block_m) row tiles.

Design. Two program orders (`GRID_ORDERS`) share one tile product: over K in `block_k` steps,
even and odd K columns contracted separately (two dots of K = block_k / 2 each): the packed weight
bytes `[block_n, block_k // 2]` decode to their even and odd planes without an interleave
(`common.fp4_planes_as_f16`: shifts and masks on whole 32-bit words in inline PTX, no convert
instruction, values * 2**-14, exact; interpret mode runs the same bit mapping in jnp, the PTX's
test reference), times the block scales. The activations arrive as ready planes (`_lhs_planes`,
one XLA fusion before the call): even and odd K columns in the dot's dtype, FP4 codes decoded by
the same mapping, FP8 codes by the convert, times their block scales. Every N tile's program reads
the same row tile, so decoding it in the kernel would decode it N / block_n times; the kernel
loads the planes masked to the group's rows, one path for every activation format.
The dots take one dtype per call (`_Statics.dot_dtype`): float16 where both operands are exact in
it (NVFP4 weights and NVFP4 activations), bfloat16 otherwise (bf16 activations, E8M0 scales),
float32 accumulation either way (Hopper has no FP4 tensor cores); the 2**-14 factors are undone
after the K loop, then the float32 sum is multiplied by the global scales (the expert's, and the
per-row NVFP4 activation scale). Why float16: with the E4M3 decode (bit operations per byte,
then the FP8 -> bf16 convert, which Triton runs through float16) the decode, not the bytes, is
the cost on the H200; the word-level float16 decode halves the decode body's time at the same
error (experiments/results/moe_matmul_ablation.md, `full` against `f16asm`). bf16 activations
keep a bf16 dot (float16 would round them: its range ends at 65504 and its normals at 2**-14): the
weights still decode to float16, take their E4M3 block scales in float16 (exact) and convert to
bf16 (exact): no per-byte bit operations nor FP8 convert, but the convert to bf16 stays, so
this path gains less than the all-float16 one.
  * "groups" (default): the group-major grid of `kernels_pallas.grouped_matmul.kernel`
    (`group_major_call`, shared with the bf16 grouped matmul; its docstring has the design):
    program (j, g) walks group g's row tiles for N tile j, the tail program writes the rows of no
    group as zeros; this module supplies the tile product as its hook.
  * "row_tiles": grid (T, N // block_n). Program (i, j) owns output tile rows
    `[i * block_m, (i + 1) * block_m)` x columns `[j * block_n, (j + 1) * block_n)` and writes it
    once. A row tile may straddle group boundaries, so the program loops over the groups that
    touch its rows, `[first[i], end[i])` (from `tile_group_ranges`, a few XLA ops on `[T]`
    vectors outside the kernel; the Triton lowering has no scalar prefetch), skips empty ones
    (`lax.cond`), and selects each group's product into that group's rows. Rows past
    `sum(group_sizes)` stay 0; the store is masked to rows < M. A tile spanning s groups does s
    passes over K: at most one extra tile per group boundary.
Tiles: Hopper's tensor cores take 16-deep K steps, so block_k = 64 gives each plane's dot only
two of them per loaded tile; `default_block_config` takes block_k = 128 (prefill) or 256 (decode,
where long K steps keep more weight bytes in flight).

Numerics. Every decoded operand is exact in the dot's dtype. E2M1 (2 significant bits) times an
E4M3 scale (4 bits) times 2**-14 has at most 6 significant bits and is a multiple of 2**-24 below
0.17: it fits float16 (subnormals included; the tensor cores and float16 arithmetic keep them)
and bfloat16. E2M1 or E4M3 elements times an E8M0 power of two fit bfloat16 while nothing under-
or overflows (FP4 operands: E8M0 block scales from about 2**-111 up). E4M3 elements times E4M3
scales would pass float16's range, so every format but NVFP4 takes bfloat16. The dot's products
are exact and accumulate in float32; only the NVFP4 global scales (arbitrary float32) are applied
after the dot, as two float32 multiplications. The reference instead rounds `code * (block_scale
* global_scale)` per element in float32, so the two agree to float32 summation error (see the
tests' tolerance).

GPU status (H200, 128 experts, K = 2048, N = 768, default tiles; experiments/results/
kernels_moe_matmul.md, the history and ablations in docs/kernels.md): decode (M = 512) 0.089 /
0.080 ms inside a device loop with bf16 / NVFP4 activations, 3.2x / 2.9x its byte limit, 1.10x /
1.22x faster than the bf16 Pallas grouped matmul (1.01x its limit): the float16 decode after the
loads is the cost; prefill (M = 65536) 195 / 196 TFLOP/s, 30% of the dense bf16 rate (654).
`weights_left` and `split_by_scale_block` are slower there (1.37-1.75x at decode): off by
default. JAX 0.11 marks the Pallas
Triton backend deprecated in favour of Mosaic GPU.

Hopper-specific: FP4 decoded to float16 or bf16 for 16-bit tensor cores (Hopper has no FP4
ones) by the word-level PTX (valid on any NVIDIA GPU, timed only on the H200), and
`default_block_config`'s tiles from the H200 sweep (run with the E4M3 decode: a re-sweep may
move them, the decode costing less). On Blackwell the default order first tries
"scaled_matmul" (cuDNN's native block-scaled FP4, `api.py`): a first Blackwell run should check
that it lowers and matches the reference, then this kernel's tolerances, then re-sweep the tiles
(148 SMs on a B200). The TPU lowering (megablox's visit list, VMEM accumulation) is `mosaic.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import (
    F16_ALIGN,
    as_e4m3,
    decode_scale_bits,
    e2m1_codes_as_f16,
    fp4_planes_as_f16,
    scale_bits,
    triton_params,
)
from kernels_pallas.fp4_moe_matmul.reference import Lhs, PackedFP4Weights, check_operands
from kernels_pallas.grouped_matmul.kernel import (
    MIN_DOT_DIM,
    fit_block,
    group_major_call,
    group_row_bounds,
    is_pow2,
    pad_rows,
    padded_rows,
    row_tile,
)
from trace_jax import fp4

# "row_tiles": grid (cdiv(M, block_m), N / block_n), a row tile loops over the groups it touches
# (fast at prefill, slow at decode, where it makes only a few dozen programs).
# "groups" (default): a program per (N tile, group) loops over its group's row tiles, so decode
# with many experts gets G x N / block_n programs. H200, G=128 K=2048 N=768 NVFP4, with the groups
# on the fast grid axis (history; experiments/results/kernels_moe_matmul.md): decode M=128
# 2.40 -> 0.14 ms, prefill M=32768 2.08 -> 1.43 ms.
GRID_ORDERS = ("row_tiles", "groups")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Tiling and Triton launch parameters (class defaults: one fixed choice;
    `default_block_config` picks per shape)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    grid: str = "groups"
    # The decoded weights as each dot's left operand (`_tile_product`); off until measured.
    weights_left: bool = False
    # The packed weights read split by scale block, [block_n, block_k / bs, bs / 2] (`_weight_
    # planes`), so the block scales broadcast over the last axis instead of being expanded to a
    # [block_n, block_k / 2] register tile; off until measured.
    split_by_scale_block: bool = False

    def __post_init__(self):
        if self.grid not in GRID_ORDERS:
            raise ValueError(f"grid must be one of {GRID_ORDERS}, got {self.grid!r}")
        for flag in ("weights_left", "split_by_scale_block"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            least = 2 * MIN_DOT_DIM if name == "block_k" else MIN_DOT_DIM  # K: two planes
            if not isinstance(value, int) or not is_pow2(value) or value < least:
                raise ValueError(f"{name} must be a power of two >= {least}, got {value!r}")
        if not isinstance(self.num_warps, int) or not is_pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")


def default_block_config(
    m: int, g: int, k: int, n: int, *, lhs_fmt: fp4.BlockFormat | None = None
) -> BlockConfig:
    """Tiles of the "groups" grid for M rows over G groups, `[M, K] x [G, N, K]`, with activations
    in `lhs_fmt` (None: bfloat16), from the H200 sweep (`experiments/results/
    kernels_moe_matmul.json` of commit 75f6f28, G = 128, K = 2048, N = 768, NVFP4 weights,
    E4M3 decode).

    Row tiles of `grouped_matmul.kernel.row_tile`, at most 256 rows (128 with quantized
    activations: in that sweep every N tile decoded them again, so wider N tiles paid off more
    than taller row tiles; with the planes decoded before the call a re-sweep may move them).
    K steps of 256 at decode and 128 at prefill (plane dots 128 and 64 deep), two load stages
    (three for bf16 activations in row tiles of up to 128: 15% faster at 8192 rows).
    Every default tile ran in that sweep (larger ones can exceed Triton's shared memory).
    block_n and block_k shrink to divide N and K (NotImplementedError if no power of two does:
    >= 16 for N, >= 32 for K); the api checks block_k against the formats' scale blocks."""
    quantized = lhs_fmt is not None
    block_m = row_tile(m, g, 128 if quantized else 256)
    if block_m <= 32:  # decode
        block_n, block_k, num_warps, num_stages = 128 if quantized else 64, 256, 4, 3
    else:
        wide = quantized and m >= 256 * g  # hundreds of rows per group
        block_n, block_k, num_warps = (256 if wide else 128), 128, 8 if block_m >= 128 else 4
        num_stages = 3 if not quantized and block_m <= 128 else 2
    return BlockConfig(
        block_m=block_m,
        block_n=fit_block(block_n, n, "block_n"),
        block_k=fit_block(block_k, k, "block_k", least=2 * MIN_DOT_DIM),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def lhs_format(lhs: Lhs) -> fp4.BlockFormat | None:
    """The activations' block format, or None for plain bfloat16."""
    return lhs.fmt if isinstance(lhs, fp4.QTensor) else None


def check_tiling(config: BlockConfig, lhs: Lhs, rhs: PackedFP4Weights) -> None:
    """Raises ValueError unless the blocks tile N and K and align with the formats' scale blocks."""
    _, n, k = rhs.shape
    if n % config.block_n:
        raise ValueError(f"block_n={config.block_n} must divide N={n}")
    if k % config.block_k:
        raise ValueError(f"block_k={config.block_k} must divide K={k}")
    for fmt in (rhs.fmt, lhs_format(lhs)):
        if fmt is not None and config.block_k % fmt.block_size:
            raise ValueError(
                f"block_k={config.block_k} must be a multiple of the {fmt.name} block size "
                f"{fmt.block_size}"
            )


def tile_group_ranges(group_sizes: jax.Array, m: int, block_m: int):
    """Group boundaries and, per row tile, the half-open range of groups that touch it.

    Returns:
      bounds: int32 `[G + 1]`: group g owns rows `[bounds[g], bounds[g + 1])`, clipped to M.
      first, end: int32 `[T]`: tile i touches groups `first[i] <= g < end[i]` (empty groups
        inside the range included; tiles past the last row get an empty range).
    """
    bounds = group_row_bounds(group_sizes, m)[:-1]  # without the tail's end
    starts, ends = bounds[:-1], bounds[1:]
    tile_start = jnp.arange(pl.cdiv(m, block_m), dtype=jnp.int32) * block_m
    tile_end = jnp.minimum(tile_start + block_m, m)
    first = jnp.searchsorted(ends, tile_start, side="right").astype(jnp.int32)
    end = jnp.searchsorted(starts, tile_end, side="left").astype(jnp.int32)
    return bounds, first, end


def exact_dtype(fmt: fp4.BlockFormat | None) -> jnp.dtype:
    """The 16-bit float that holds every decoded operand value of `fmt` exactly (None: bfloat16
    activations): float16 for E2M1 codes times E4M3 block scales (times the FP4 decode's 2**-14:
    at most 6 significant bits, multiples of 2**-24 below 0.17); bfloat16 otherwise (E8M0 scales
    need its exponent range, E4M3 codes times E4M3 scales its range past 65504)."""
    if fmt is not None and fmt.is_fp4 and fmt.scale is fp4.ScaleType.E4M3:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(jnp.bfloat16)


def dot_dtype(lhs_fmt: fp4.BlockFormat | None, w_fmt: fp4.BlockFormat) -> jnp.dtype:
    """The dots' operand dtype: float16 where both operands are exact in it (NVFP4 x NVFP4), else
    bfloat16: a bf16 activation or an E8M0 scale does not fit float16, while float16 operands fit
    bfloat16."""
    if exact_dtype(lhs_fmt) == exact_dtype(w_fmt) == jnp.float16:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(jnp.bfloat16)


def decode_unscale(lhs_fmt: fp4.BlockFormat | None) -> float:
    """Undoes the 2**-14 of every FP4 operand's float16-aligned decode (the weights', and the
    activations' in an FP4 format): a power of two, exact on the float32 sum."""
    fp4_operands = 1 + (lhs_fmt is not None and lhs_fmt.is_fp4)
    return (1.0 / F16_ALIGN) ** fp4_operands


def decoded_operand(
    codes: jax.Array, scales: jax.Array, fmt: fp4.BlockFormat, dtype: jnp.dtype
) -> jax.Array:
    """Block-scaled codes as a dot operand, exactly: codes uint8 `[..., K]` (one per byte: E2M1
    in the low nibble, or E4M3 bits) times their block scales `[..., K / block_size]` (`fmt`'s
    scale dtype) -> `dtype` `[..., K]`, FP4 values times 2**-14 (`common.e2m1_codes_as_f16`),
    without the global scale. `dtype` is `dot_dtype` of the call's formats (see `_scaled`)."""
    s = decode_scale_bits(scale_bits(scales), fmt).astype(exact_dtype(fmt))
    s = jnp.repeat(s, fmt.block_size, axis=-1)
    values = e2m1_codes_as_f16(codes) if fmt.is_fp4 else as_e4m3(codes)
    return (values.astype(s.dtype) * s).astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Statics:
    m: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    lhs_fmt: fp4.BlockFormat | None
    w_fmt: fp4.BlockFormat
    out_dtype: jnp.dtype
    inline_asm: bool  # the weights' FP4 decode in PTX (compiled Triton only)
    weights_left: bool = False  # `BlockConfig.weights_left`
    split_by_scale_block: bool = False  # `BlockConfig.split_by_scale_block`

    @property
    def dot_dtype(self) -> jnp.dtype:
        return dot_dtype(self.lhs_fmt, self.w_fmt)

    @property
    def unscale(self) -> float:
        return decode_unscale(self.lhs_fmt)

    @property
    def num_lhs_refs(self) -> int:
        """The two planes, then the NVFP4 activations' per-row global scale."""
        return 3 if self.lhs_fmt is not None and self.lhs_fmt.has_global_scale else 2


def expand_blocks(s: jax.Array, block: int) -> jax.Array:
    """`[R, NB]` per-block values -> `[R, NB * block]` per-element values."""
    r, nb = s.shape
    return jnp.broadcast_to(s[:, :, None], (r, nb, block)).reshape(r, nb * block)


def _scaled(values: jax.Array, scales: jax.Array, st: _Statics) -> jax.Array:
    """`values * scales` as a dot operand of `st.dot_dtype`, exactly: both are in the scales' dtype
    (`exact_dtype` of their format), so is the product, and a float16 product is also exact in
    bfloat16 (at most 6 significant bits, at least 2**-24)."""
    return (values.astype(scales.dtype) * scales).astype(st.dot_dtype)


def _lhs_planes(lhs: Lhs, st: _Statics) -> list[jax.Array]:
    """The activations as the kernel reads them (XLA, before the call): even and odd K columns,
    `st.dot_dtype` `[M, K / 2]` each, times the block scales and 2**-14 for FP4 (the values the
    weights' decode makes: exact, see `_scaled`), then the NVFP4 per-row global scale, float32
    `[M]` (applied after the K loop). 2 bytes per value where the codes take 1 and their scales
    1 per block: small next to the weights at decode, and decoded once, not once per N tile."""
    m, k = lhs.shape
    if st.lhs_fmt is None:
        pairs = lhs.reshape(m, k // 2, 2)
        return [pairs[..., 0].astype(st.dot_dtype), pairs[..., 1].astype(st.dot_dtype)]
    fmt = st.lhs_fmt
    pairs = decoded_operand(lhs.codes, lhs.scales, fmt, st.dot_dtype).reshape(m, k // 2, 2)
    planes = [pairs[..., 0], pairs[..., 1]]
    if fmt.has_global_scale:
        planes.append(jnp.broadcast_to(lhs.global_scale.astype(jnp.float32), (m, 1)).reshape(m))
    return planes


def _weight_planes(w_refs, g, k0, st: _Statics) -> tuple[jax.Array, jax.Array]:
    """Even and odd K columns of expert g's weights at K offset k0, `st.dot_dtype` `[block_n,
    block_k/2]` each, times 2**-14 and the block scales (not the global scale)."""
    fmt = st.w_fmt
    n_blocks = st.block_k // fmt.block_size
    sbits = w_refs[1][g, :, pl.ds(k0 // fmt.block_size, n_blocks)]
    if st.split_by_scale_block:  # codes ref [G, N, K / bs, bs / 2]: one row of bytes per block
        packed = w_refs[0][g, :, pl.ds(pl.multiple_of(k0 // fmt.block_size, n_blocks), n_blocks)]
        scales = decode_scale_bits(sbits, fmt).astype(exact_dtype(fmt))[:, :, None]
        bn = packed.shape[0]
        return tuple(  # [bn, n_blocks, bs / 2] -> [bn, bk / 2]: contiguous axes merged
            _scaled(plane, scales, st).reshape(bn, st.block_k // 2)
            for plane in fp4_planes_as_f16(packed, inline_asm=st.inline_asm)
        )
    half = pl.multiple_of(k0 // 2, st.block_k // 2)
    packed = w_refs[0][g, :, pl.ds(half, st.block_k // 2)]  # [bn, bk / 2]: byte i = (2i, 2i + 1)
    scales = expand_blocks(
        decode_scale_bits(sbits, fmt).astype(exact_dtype(fmt)), fmt.block_size // 2
    )
    # Shifts and masks on whole words, no convert instruction (`common.fp4_planes_as_f16`).
    even, odd = fp4_planes_as_f16(packed, inline_asm=st.inline_asm)
    return _scaled(even, scales, st), _scaled(odd, scales, st)


def _tile_product(in_refs, g, rows, in_tile, *, st: _Statics):
    """The one tile product: the row window `rows` of the lhs refs (masked to `in_tile`) times
    group g's weights over the program's N tile, float32 `[block_m, block_n]`, every scale
    applied. The "groups" grid's hook (`grouped_matmul.kernel.group_major_call`) and the
    row-tile kernel's per-group step. `in_refs`: the lhs refs, then the weight refs."""
    lhs_refs = in_refs[: st.num_lhs_refs]
    w_refs = in_refs[st.num_lhs_refs :]
    bm, bn, half = st.block_m, st.block_n, st.block_k // 2
    mask = jnp.broadcast_to(in_tile[:, None], (bm, half))

    def product(a, w):
        # weights_left: `[bn, bm]`, the decoded weights as the dot's left operand, which
        # Hopper's wgmma reads from registers (its right operand it reads from shared memory,
        # where decoded weights on the right would go first); else `[bm, bn]`.
        if st.weights_left:
            return jnp.dot(w, a.T, preferred_element_type=jnp.float32)
        return jnp.dot(a, w.T, preferred_element_type=jnp.float32)

    def k_step(kk, acc):
        # K split into even and odd columns: packed weight bytes decode without interleave.
        k0 = pl.multiple_of(kk * st.block_k, st.block_k)
        cols = pl.ds(pl.multiple_of(k0 // 2, half), half)
        # [bm, bk / 2] each, 0 outside the group's rows
        a_even, a_odd = (plgpu.load(a.at[rows, cols], mask=mask, other=0.0) for a in lhs_refs[:2])
        w_even, w_odd = _weight_planes(w_refs, g, k0, st)  # [bn, bk / 2] each
        return acc + product(a_even, w_even) + product(a_odd, w_odd)

    shape = (bn, bm) if st.weights_left else (bm, bn)
    acc = jax.lax.fori_loop(0, st.k // st.block_k, k_step, jnp.zeros(shape, jnp.float32))
    if st.weights_left:
        acc = acc.T  # once per tile, after the K loop
    acc = acc * st.unscale  # the FP4-decode factors, powers of two: exact
    if st.w_fmt.has_global_scale:
        acc = acc * w_refs[2][g]
    if st.lhs_fmt is not None and st.lhs_fmt.has_global_scale:
        acc = acc * plgpu.load(lhs_refs[2].at[rows], mask=in_tile, other=1.0)[:, None]
    return acc


def _kernel(*refs, st: _Statics):
    """The "row_tiles" grid's program (i, j): row tile i over the groups that touch it."""
    bounds_ref, first_ref, end_ref = refs[:3]
    in_refs, out_ref = refs[3:-1], refs[-1]
    bm, bn = st.block_m, st.block_n
    i = pl.program_id(0)
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)

    def group_step(g, acc):
        lo = bounds_ref[g]
        hi = bounds_ref[g + 1]
        in_group = (rows >= lo) & (rows < hi)

        def visit(acc):
            acc_g = _tile_product(in_refs, g, slice(None), in_group, st=st)
            return jnp.where(in_group[:, None], acc_g, acc)

        return jax.lax.cond(hi > lo, visit, lambda acc: acc, acc)

    acc = jax.lax.fori_loop(first_ref[i], end_ref[i], group_step, jnp.zeros((bm, bn), jnp.float32))
    out_mask = jnp.broadcast_to((rows < st.m)[:, None], (bm, bn))
    plgpu.store(out_ref, acc.astype(st.out_dtype), mask=out_mask)


def fp4_moe_matmul_pallas(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    config: BlockConfig = BlockConfig(),
    interpret: bool = False,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """Grouped `lhs [M, K] x rhs [G, N, K] -> [M, N]` (ragged_dot contract) in one Pallas call.

    Args:
      lhs: bfloat16 `[M, K]` or a `QTensor` `[M, K]` (MXFP4, NVFP4 or MXFP8, blocks along K).
      rhs: packed FP4 weights `[G, N, K]`.
      group_sizes: int32 `[G]`, `sum(group_sizes) <= M`; rows past the sum give 0.
      config: tiles (`block_n` must divide N, `block_k` must divide K and be a multiple of both
        formats' block sizes) and Triton launch parameters.
      interpret: run in Pallas interpret mode (CPU tests).
      out_dtype: output dtype (float32 accumulation either way).
    """
    m, _, n, _ = check_operands(lhs, rhs, group_sizes)
    check_tiling(config, lhs, rhs)
    out_dtype = jnp.dtype(out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    return _pallas_call(
        lhs, rhs, group_sizes, config=config, interpret=interpret, out_dtype=out_dtype
    )


def _statics(lhs, rhs, config: BlockConfig, interpret: bool, out_dtype) -> _Statics:
    m, k = lhs.shape
    return _Statics(
        m, k, config.block_m, config.block_n, config.block_k, lhs_format(lhs), rhs.fmt, out_dtype,
        not interpret, config.weights_left, config.split_by_scale_block,
    )  # fmt: skip


def _weight_operands(rhs: PackedFP4Weights, st: _Statics, index_map) -> tuple[list, list]:
    """(operands, block specs) of the weights for the program's N tile: the packed codes
    (`[G, N, K / 2]`, or `[G, N, K / bs, bs / 2]` split by scale block), the scale bits and
    NVFP4's per-expert global scale. `index_map(j)`: the N tile's index from the program ids."""
    g, n, k = rhs.shape
    bn, bs = st.block_n, st.w_fmt.block_size
    codes = rhs.codes
    if st.split_by_scale_block:
        codes = codes.reshape(g, n, k // bs, bs // 2)
    operands = [codes, scale_bits(rhs.scales)]
    trailing = (0,) * (codes.ndim - 2)
    specs = [
        pl.BlockSpec((g, bn, *codes.shape[2:]), lambda *ids: (0, index_map(*ids), *trailing)),
        pl.BlockSpec((g, bn, k // bs), lambda *ids: (0, index_map(*ids), 0)),
    ]
    if rhs.fmt.has_global_scale:
        operands.append(rhs.global_scale.reshape(g))
        specs.append(pl.BlockSpec((g,), lambda *ids: (0,)))
    return operands, specs


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def _pallas_call(lhs, rhs, group_sizes, *, config, interpret, out_dtype):
    if config.grid == "groups":
        return _group_major_call(lhs, rhs, group_sizes, config, interpret, out_dtype)
    m, k = lhs.shape
    g, n, _ = rhs.shape
    bm, bn = config.block_m, config.block_n
    num_tiles = pl.cdiv(m, bm)
    st = _statics(lhs, rhs, config, interpret, out_dtype)

    def whole(size):
        return pl.BlockSpec((size,), lambda i, j: (0,))

    bounds, first, end = tile_group_ranges(group_sizes, m, bm)
    w_operands, w_specs = _weight_operands(rhs, st, lambda i, j: j)
    operands = [bounds, first, end, *_lhs_planes(lhs, st), *w_operands]
    in_specs = [whole(g + 1), whole(num_tiles), whole(num_tiles)]
    in_specs += [pl.BlockSpec((bm, k // 2), lambda i, j: (i, 0))] * 2  # row panels
    in_specs += [pl.BlockSpec((bm,), lambda i, j: (i,))] * (st.num_lhs_refs - 2)
    in_specs += w_specs

    return pl.pallas_call(
        functools.partial(_kernel, st=st),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_tiles, n // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="fp4_moe_matmul",
    )(*operands)


def _group_major_call(lhs, rhs, group_sizes, config, interpret, out_dtype):
    """The "groups" grid: `grouped_matmul.kernel.group_major_call` with the FP4 tile product."""
    m, k = lhs.shape
    n = rhs.shape[1]
    st = _statics(lhs, rhs, config, interpret, out_dtype)
    mp = padded_rows(m, config.block_m)

    def whole(*shape):
        return pl.BlockSpec(shape, lambda j, gi: (0,) * len(shape))

    w_operands, w_specs = _weight_operands(rhs, st, lambda j, gi: j)
    operands = [pad_rows(a, mp) for a in _lhs_planes(lhs, st)] + w_operands
    in_specs = [whole(mp, k // 2)] * 2 + [whole(mp)] * (st.num_lhs_refs - 2) + w_specs
    out = group_major_call(
        functools.partial(_tile_product, st=st),
        operands,
        in_specs,
        group_sizes,
        rows_total=mp,
        n=n,
        config=config,
        out_dtype=out_dtype,
        interpret=interpret,
        name="fp4_moe_matmul_group_major",
    )
    return out[:m]
