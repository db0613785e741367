"""The FP4 MoE matmul for many rows per expert (prefill): the packed weights decoded once per call
to 16-bit dot operands, then the bf16 grouped matmul's program grid over them (Triton lowering),
or megablox's `gmm` over them (Mosaic lowering, `fp4_moe_matmul_predecoded_mosaic`).

Why. At prefill each weight tile meets hundreds of rows, so the product is bound by the tensor
cores, not by bytes, and `kernel.py`'s in-kernel decode, done again for every row tile, is work
the dense rate does not hide: on the H200 the FP4 kernel runs at 30% of the dense bf16 matmul
rate at M = 65536 (195 TFLOP/s), the bf16 grouped matmul on the same grid at 62% (404;
experiments/results/kernels_moe_matmul.md). Decoding the weights once is one pass over them
(G x N x K codes read at half a byte, written at two), about 0.16 ms at the H200's copy bandwidth
for 128 experts x 768 x 2048, against about 0.5 ms saved on that product at 65536 rows. At
decode (a few rows per expert) the bytes are the cost, and decoding first moves 9x the packed
weights' bytes (read half a byte, write two, read two): `api.predecode_by_default` keeps the
in-kernel decode there.

The decode pass. As one XLA fusion (`decoded_weights`: unpack the nibbles, interleave, scale)
it ran at about a third of the copy bandwidth on the H200 (0.49 ms for those weights), which
ate the gain. `decode_weights` is a Pallas (Triton) pass instead: a program per
`[DECODE_BLOCK_N, DECODE_BLOCK_K]` tile decodes the tile's bytes to their even and odd planes
with the in-kernel decode's word-level PTX (`common.fp4_planes_as_f16`), scales them, and
interleaves them in registers (`jnp.stack` on the last axis: Triton's `join`) into whole rows
of 16-bit values, one contiguous store per row. Same values, bit for bit, as `decoded_weights`
(the tests' reference; the TPU path's decode).

Numerics: those of `kernel.py`. Both operands decode exactly (`kernel.decoded_operand`) to the
dtype `kernel.dot_dtype` picks (float16 for NVFP4 x NVFP4, bfloat16 otherwise), FP4 values times
2**-14; the products accumulate in float32 over K in `block_k` steps; after the K loop the 2**-14
factors are undone and the global scales applied, in float32, in the kernel's order. The two
paths differ by float32 summation order only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import decode_scale_bits, fp4_planes_as_f16, scale_bits, triton_params
from kernels_pallas.fp4_moe_matmul.kernel import (
    decode_unscale,
    decoded_operand,
    dot_dtype,
    exact_dtype,
    expand_blocks,
    lhs_format,
)
from kernels_pallas.fp4_moe_matmul.reference import Lhs, PackedFP4Weights
from kernels_pallas.grouped_matmul.api import grouped_matmul_megablox
from kernels_pallas.grouped_matmul.kernel import (
    BlockConfig,
    dot_tile_product,
    group_major_call,
    pad_rows,
    padded_rows,
)
from trace_jax import fp4

# The decode pass's tile: each program reads `[32, 256]` bytes of codes (8 KiB, whole 128-byte
# lines) and writes `[32, 512]` 16-bit values (32 KiB): enough bytes in flight per program for a
# bandwidth-bound pass, 12288 programs over 128 x 768 x 2048 weights (93 per SM on an H200).
# Smaller shapes take the largest power of two that divides them.
DECODE_BLOCK_N = 32
DECODE_BLOCK_K = 512


def decoded_weights(rhs: PackedFP4Weights, dtype: jnp.dtype) -> jax.Array:
    """The packed weights as dot operands in one XLA fusion: `dtype` `[G, N, K]`, values times
    2**-14, without the global scale (the TPU path's decode, and `decode_weights`' reference)."""
    return decoded_operand(fp4.unpack_fp4(rhs.codes), rhs.scales, rhs.fmt, dtype)


def _decode_kernel(codes_ref, sbits_ref, out_ref, *, fmt: fp4.BlockFormat, dtype, inline_asm):
    """One `[block_n, block_k]` tile: bytes `[1, block_n, block_k / 2]` (byte i holds columns 2i,
    low nibble, and 2i + 1), scale bits `[1, block_n, block_k / bs]` -> `dtype` values."""
    packed = codes_ref[0]
    bn, half = packed.shape
    scales = decode_scale_bits(sbits_ref[0], fmt).astype(exact_dtype(fmt))
    scales = expand_blocks(scales, fmt.block_size // 2)  # [bn, bk / 2]: a plane's elements
    planes = [
        (plane.astype(scales.dtype) * scales).astype(dtype)  # exact (see `kernel._scaled`)
        for plane in fp4_planes_as_f16(packed, inline_asm=inline_asm)
    ]
    # [bn, bk / 2, 2] -> [bn, bk]: even and odd columns interleaved in registers (Triton's join).
    out_ref[0] = jnp.stack(planes, axis=-1).reshape(bn, 2 * half)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def decode_weights(
    rhs: PackedFP4Weights, dtype: jnp.dtype, *, interpret: bool = False
) -> jax.Array:
    """The packed weights as dot operands: `dtype` `[G, N, K]` (float16 or bfloat16, as
    `kernel.dot_dtype` picks), values times 2**-14, without the global scale; equal bit for
    bit to `decoded_weights`. One Pallas (Triton) call, grid `(G, N / bn, K / bk)` with
    `DECODE_BLOCK_N` x `DECODE_BLOCK_K` tiles (the largest powers of two dividing N and K up to
    those). `interpret`: Pallas interpret mode (CPU tests; the PTX decode's jnp twin)."""
    g, n, k = rhs.shape
    fmt = rhs.fmt
    # K is a multiple of the block size (16 or 32), which divides DECODE_BLOCK_K: so does bk.
    bn, bk = math.gcd(n, DECODE_BLOCK_N), math.gcd(k, DECODE_BLOCK_K)
    kernel = functools.partial(
        _decode_kernel, fmt=fmt, dtype=jnp.dtype(dtype), inline_asm=not interpret
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((g, n, k), dtype),
        grid=(g, n // bn, k // bk),
        in_specs=[
            pl.BlockSpec((1, bn, bk // 2), lambda e, j, kk: (e, j, kk)),
            pl.BlockSpec((1, bn, bk // fmt.block_size), lambda e, j, kk: (e, j, kk)),
        ],
        out_specs=pl.BlockSpec((1, bn, bk), lambda e, j, kk: (e, j, kk)),
        compiler_params=triton_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="fp4_weights_decode",
    )(rhs.codes, scale_bits(rhs.scales))


def decoded_lhs(lhs: Lhs, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array | None]:
    """The activations as the dot's left operand, `dtype` `[M, K]` (bfloat16 ones as they are),
    and the NVFP4 per-row global scale, float32 `[M]` (None for other formats)."""
    fmt = lhs_format(lhs)
    if fmt is None:
        return lhs, None
    values = decoded_operand(lhs.codes, lhs.scales, fmt, dtype)
    if not fmt.has_global_scale:
        return values, None
    m = lhs.shape[0]
    return values, jnp.broadcast_to(lhs.global_scale.astype(jnp.float32), (m, 1)).reshape(m)


def _tile_product(in_refs, g, rows, in_tile, *, k, block_k, row_scaled, unscale):
    """`dot_tile_product` over the decoded operands, then the kernel's epilogue: the 2**-14
    factors undone, the expert's global scale, the rows' global scales (float32)."""
    lhs_ref, rest = in_refs[0], in_refs[1:]
    row_scale_ref, rest = (rest[0], rest[1:]) if row_scaled else (None, rest)
    w_ref, w_scale_refs = rest[0], rest[1:]
    acc = dot_tile_product([lhs_ref, w_ref], g, rows, in_tile, k=k, block_k=block_k, precision=None)
    acc = acc * unscale
    if w_scale_refs:
        acc = acc * w_scale_refs[0][g]
    if row_scale_ref is not None:
        acc = acc * plgpu.load(row_scale_ref.at[rows], mask=in_tile, other=1.0)[:, None]
    return acc


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def fp4_moe_matmul_predecoded(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    config: BlockConfig,
    interpret: bool = False,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """Grouped `lhs [M, K] x rhs [G, N, K] -> [M, N]` (ragged_dot contract): the weights decoded
    in one Pallas pass (`decode_weights`), then one Pallas call on the group-major grid. The
    operands and tiles are the api's to check (`api.fp4_moe_matmul(..., predecode=True)`, which
    also answers M = 0).

    Args:
      lhs: bfloat16 `[M, K]` or a `QTensor` `[M, K]` (MXFP4, NVFP4 or MXFP8, blocks along K).
      rhs: packed FP4 weights `[G, N, K]`.
      group_sizes: int32 `[G]`, `sum(group_sizes) <= M`; rows past the sum give 0.
      config: the bf16 grouped matmul's tiles (`grouped_matmul.api.block_config`: block_n
        divides N, block_k K) and Triton launch parameters.
      interpret: run in Pallas interpret mode (CPU tests).
      out_dtype: output dtype (float32 accumulation either way).
    """
    m, k = lhs.shape
    g, n, _ = rhs.shape
    dtype = dot_dtype(lhs_format(lhs), rhs.fmt)
    a, row_scale = decoded_lhs(lhs, dtype)
    mp = padded_rows(m, config.block_m)

    def whole(*shape):
        return pl.BlockSpec(shape, lambda j, gi: (0,) * len(shape))

    operands, in_specs = [pad_rows(a, mp)], [whole(mp, k)]
    if row_scale is not None:
        operands.append(pad_rows(row_scale, mp))
        in_specs.append(whole(mp))
    operands.append(decode_weights(rhs, dtype, interpret=interpret))
    in_specs.append(pl.BlockSpec((g, config.block_n, k), lambda j, gi: (0, j, 0)))
    if rhs.fmt.has_global_scale:
        operands.append(rhs.global_scale.reshape(g))
        in_specs.append(whole(g))
    tile_product = functools.partial(
        _tile_product,
        k=k,
        block_k=config.block_k,
        row_scaled=row_scale is not None,
        unscale=decode_unscale(lhs_format(lhs)),
    )
    out = group_major_call(
        tile_product,
        operands,
        in_specs,
        group_sizes,
        rows_total=mp,
        n=n,
        config=config,
        out_dtype=out_dtype,
        interpret=interpret,
        name="fp4_moe_matmul_predecoded",
    )
    return out[:m]


def fp4_moe_matmul_predecoded_mosaic(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    tiling: tuple[int, int, int],
    interpret=None,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """The same product on a TPU: both operands decoded in XLA to bfloat16 (exact, as in the
    Triton path: at most 6 significant bits, float32's exponent range; megablox takes no
    float16), megablox `gmm` over them with float32 output (`grouped_matmul_megablox`, `tiling`
    its `megablox_tiling`; rows past the groups 0), then the epilogue in XLA in the Triton
    kernel's order: the 2**-14 factors, each row's expert global scale, the rows' own.
    `interpret`: None (compiled for a TPU) or `pltpu.InterpretParams`."""
    m, g = lhs.shape[0], rhs.shape[0]
    a, row_scale = decoded_lhs(lhs, jnp.dtype(jnp.bfloat16))
    w = decoded_weights(rhs, jnp.dtype(jnp.bfloat16))
    out = grouped_matmul_megablox(
        a, w, group_sizes, tiling=tiling, interpret=interpret, out_dtype=jnp.float32
    )
    out = out * decode_unscale(lhs_format(lhs))
    if rhs.global_scale is not None:  # rows past the groups take the last expert's: they are 0
        expert = jnp.repeat(jnp.arange(g), group_sizes, total_repeat_length=m)
        out = out * rhs.global_scale.reshape(g)[expert][:, None]
    if row_scale is not None:
        out = out * row_scale[:, None]
    return out.astype(out_dtype)
