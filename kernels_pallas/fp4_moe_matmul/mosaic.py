"""Pallas grouped matmul with packed FP4 weights, decoded in-kernel (Mosaic lowering on a TPU).

Axis legend: M rows of lhs (sorted by group), K contraction, N outputs, G groups (experts);
Mp = M rounded up to block_m, T = Mp / block_m row tiles, V = T + G visits.

The same contract as `kernel.fp4_moe_matmul_pallas` (the `ragged_dot` contract, packed weights in
their `PackedFP4Weights` layout), laid out the TPU way after megablox's `gmm`
(`jax.experimental.pallas.ops.tpu.megablox`):
  * Visits. Group sizes become scalar-prefetched metadata (megablox's `make_group_metadata`, in
    SMEM): group row offsets and a list of (row tile, group) visits, each group visiting the row
    tiles its rows touch, in row order. The rows in no group (from `sum(group_sizes)` to Mp) are
    one more group, the tail, so every row tile is visited and rows past the sum get zeros there.
    The grid is (N / block_n, V, K / block_k), N tiles "parallel", visits and K steps
    "arbitrary": a visit accumulates its K steps in a float32 VMEM scratch and on its last K step
    stores the rows of its group into the output tile, which stays in VMEM while consecutive
    visits of one row tile revisit it. Index maps read the visit's row tile and expert from the
    metadata, so only the visited expert's weight tile is fetched. V is static (the most visits
    any group sizes need); visits past the real ones map to the last real visit's blocks (no DMA)
    and do nothing, and the tail's visits fetch no new weights.
  * Nibbles without an interleave, as in the Triton kernel: each packed byte holds K columns
    2i and 2i + 1, so the low nibbles of a weight tile are its even columns and the high nibbles its
    odd ones; the activations arrive split into even and odd columns (a copy outside the kernel,
    small next to the weights), and each K step contracts the even planes and the odd planes
    separately (two bf16 MXU dots of depth block_k / 2, float32 accumulation). Interleaving the
    nibbles back into K order in-kernel would take lane shuffles, which the TPU's vector unit
    does only at high cost, while the split costs nothing in-kernel.
  * Decode on the VPU in int32 and float32 (uint8 tiles are widened to int32 first, the type
    whose shifts and masks Mosaic lowers on every TPU generation): `common.unpack_nibbles`, and
    the quantizer's own decoders (`numerics.decode` for E2M1 / E4M3 codes,
    `common.decode_scale_bits` for block scales). The Triton kernel's route through the hardware
    FP8 -> bf16 convert is not taken: not every TPU generation converts FP8 vectors.
  * Block scales. A scale covers block_size / 2 consecutive columns of a plane, along lanes; a
    per-lane repeat is a relayout Mosaic may not lower. Instead, a tile's scales are spread onto
    its columns by one more MXU dot: `scales [rows, NBp] @ E [NBp, block_k / 2]` with E the 0/1
    matrix of which block holds which column of this K step (built from iotas; one nonzero per
    column, so the product is exact). The scale bits of a whole row of blocks (`K / block_size`,
    the full last dim, so any block_k is legal) arrive once per visit and are decoded once into a
    bfloat16 VMEM scratch padded with zeros to NBp, a multiple of 128 lanes.
  * Per-row float32 factors, the expert's NVFP4 global scale and the NVFP4 activations' row
    scale, are combined outside the kernel into one factor per row (a gather over M) and applied
    after the K sum, as in the Triton kernel.
Tiles: (block_m, block_n) output blocks; block_n and block_k / 2 are multiples of 128 lanes;
block_m a multiple of 16 (bf16 sublane tiles) or 32 (uint8 code tiles, quantized activations).

Numerics: as the Triton kernel's (kernel.py): every decoded operand is exact in bfloat16 (E2M1 or
E4M3 code times an E4M3 or power-of-two scale), products are exact and accumulate in float32,
in K order per step but even plane before odd, so kernel and reference (per-element float32
dequantization, HIGHEST ragged_dot) differ by float32 summation order and the rounding of the
global scales only. Differences from the Triton kernel: values are decoded straight to float32
(no 2**-6 E4M3 alignment to undo); the global scales are multiplied together first (one float32
rounding more per row). Scales the bfloat16 scratch holds as subnormals (E8M0 2**-127, i.e.
all-zero blocks) may be flushed to zero by the TPU; and a NaN block scale spreads over its whole
row of the weights or activations through the spreading dot (NaN * 0), which reaches only the
output elements the NaN reaches in the reference anyway (one output column of the expert's rows,
or one output row).

Status: tested in TPU interpret mode on the CPU against the reference and lowered for a TPU
(`tpu_custom_call`) in CI; never run on a TPU. A first TPU run should check that Mosaic's layout
passes accept the int32-widened nibble decode and the masked store of the scale scratch, the
speed of the VPU decode against the MXU (about 20 vector operations per weight element; decode
dominates at small block_m), the cost of the scale-spreading dots for long K (NBp = 512 lanes at
K = 7168 with NVFP4), and the per-grid-step overhead of the K steps of the tail's visits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

from kernels_pallas.common import decode_scale_bits, scale_bits, unpack_nibbles
from kernels_pallas.fp4_moe_matmul.reference import Lhs, PackedFP4Weights, check_operands
from kernels_pallas.grouped_matmul.kernel import group_row_bounds, pad_rows
from trace_jax import fp4
from trace_jax.fp4 import numerics

LANES = 128  # TPU vector lanes: the unit of block_n, block_k / 2 and the scale scratch width
BF16_ROWS = 16  # sublane tile of bfloat16 (two rows per 32-bit sublane)
BYTE_ROWS = 32  # sublane tile of 8-bit arrays (four rows per 32-bit sublane)


@dataclasses.dataclass(frozen=True)
class _Statics:
    g: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    lhs_fmt: fp4.BlockFormat | None
    w_fmt: fp4.BlockFormat
    has_row_factor: bool
    out_dtype: jnp.dtype

    @property
    def k_steps(self) -> int:
        return self.k // self.block_k

    @property
    def num_lhs_refs(self) -> int:
        """Even and odd columns, then the scale bits of quantized activations."""
        return 2 if self.lhs_fmt is None else 3


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _scale_width(k: int, fmt: fp4.BlockFormat) -> int:
    """Lanes of a decoded scale scratch: K / block_size padded to whole vregs."""
    return _round_up(k // fmt.block_size, LANES)


def _visit_plan(group_sizes: jax.Array, m: int, mp: int, block_m: int):
    """Scalar-prefetch metadata of the visits (megablox's `make_group_metadata`), with the tail.

    Returns (offsets, group_ids, tile_ids, meta):
      offsets int32 `[G + 2]`: group g owns rows `[offsets[g], offsets[g + 1])` (ends clipped to
        M); group G, the tail, the rows `[offsets[G], Mp)` of no group.
      group_ids, tile_ids int32 `[V]`: visit v computes row tile `tile_ids[v]` for group
        `group_ids[v]`; visits of one row tile are consecutive; empty groups have none.
      meta int32 `[2]`: the number of real visits, and the last non-empty real group (whose
        weight blocks the tail's visits keep, so that they fetch none).
    """
    g = group_sizes.shape[0]
    bounds = group_row_bounds(group_sizes, m)  # [G + 2], tail ending at M
    sizes = jnp.diff(bounds.at[-1].set(mp))  # [G + 1], tail ending at Mp
    (offsets, group_ids, tile_ids), num_visits = make_group_metadata(
        group_sizes=sizes,
        m=mp,
        tm=block_m,
        start_group=jnp.int32(0),
        num_nonzero_groups=g + 1,
        visit_empty_groups=False,
    )
    last_real = jnp.max(jnp.where(sizes[:g] > 0, jnp.arange(g, dtype=jnp.int32), 0))
    meta = jnp.stack([num_visits.astype(jnp.int32), last_real])
    return offsets.astype(jnp.int32), group_ids, tile_ids, meta


def _block_spread(k_step, fmt: fp4.BlockFormat, st: _Statics) -> jax.Array:
    """bfloat16 `[NBp, block_k / 2]` 0/1 matrix: entry (b, c) is 1 iff scale block b holds plane
    column c of K step `k_step` (plane column p stands for K columns 2p and 2p + 1)."""
    half = st.block_k // 2
    per_block = fmt.block_size // 2  # plane columns per scale block
    shape = (_scale_width(st.k, fmt), half)
    block_start = jax.lax.broadcasted_iota(jnp.int32, shape, 0) * per_block
    column = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + k_step * half
    inside = (column >= block_start) & (column < block_start + per_block)
    return jnp.where(inside, 1.0, 0.0).astype(jnp.bfloat16)


def _decode_scales_into(scratch, bits_ref, fmt: fp4.BlockFormat, k: int) -> None:
    """Decodes a row of scale bits `[rows, K / block_size]` into a zero-padded bf16 scratch."""
    nb = k // fmt.block_size
    if nb < scratch.shape[1]:
        # Uninitialized (NaN) lanes would give NaN * 0 = NaN in the spreading dot.
        scratch[...] = jnp.zeros(scratch.shape, scratch.dtype)
    scratch[:, :nb] = decode_scale_bits(bits_ref[...], fmt).astype(jnp.bfloat16)


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a [R, C] @ b [S, C]^T` on the MXU, float32 result."""
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _kernel(offsets, group_ids, tile_ids, meta, *refs, st: _Statics):
    lhs_refs = refs[: st.num_lhs_refs]
    rest = refs[st.num_lhs_refs :]
    w_codes_ref, w_bits_ref = rest[:2]
    factor_ref = rest[2] if st.has_row_factor else None
    out_ref, acc_ref, w_scale_ref, *a_scale = rest[2 + st.has_row_factor :]
    v, kk = pl.program_id(1), pl.program_id(2)
    group = group_ids[v]
    real_visit = v < meta[0]
    computes = real_visit & (group < st.g)  # the tail's visits only store zeros

    @pl.when(real_visit & (kk == 0))
    def _start_visit():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(computes & (kk == 0))
    def _decode_visit_scales():
        _decode_scales_into(w_scale_ref, w_bits_ref, st.w_fmt, st.k)
        if st.lhs_fmt is not None:
            _decode_scales_into(a_scale[0], lhs_refs[2], st.lhs_fmt, st.k)

    @pl.when(computes)
    def _accumulate():
        w_spread = _block_spread(kk, st.w_fmt, st)
        w_scale = jnp.dot(w_scale_ref[...], w_spread, preferred_element_type=jnp.float32)
        lo, hi = unpack_nibbles(w_codes_ref[...])  # int32 [bn, bk / 2]: even, odd K columns
        e2m1 = st.w_fmt.elem
        w_planes = [(numerics.decode(c, e2m1) * w_scale).astype(jnp.bfloat16) for c in (lo, hi)]
        if st.lhs_fmt is None:
            a_planes = [lhs_refs[0][...], lhs_refs[1][...]]
        else:
            same_blocks = st.lhs_fmt.block_size == st.w_fmt.block_size
            a_spread = w_spread if same_blocks else _block_spread(kk, st.lhs_fmt, st)
            a_scale_cols = jnp.dot(a_scale[0][...], a_spread, preferred_element_type=jnp.float32)
            a_planes = [
                (numerics.decode(r[...], st.lhs_fmt.elem) * a_scale_cols).astype(jnp.bfloat16)
                for r in lhs_refs[:2]
            ]
        acc_ref[...] += _dot_nt(a_planes[0], w_planes[0]) + _dot_nt(a_planes[1], w_planes[1])

    @pl.when(real_visit & (kk == st.k_steps - 1))
    def _store_group_rows():
        tile = tile_ids[v]
        shape = (st.block_m, st.block_n)
        rows = tile * st.block_m + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        in_group = (rows >= offsets[group]) & (rows < offsets[group + 1])
        value = acc_ref[...]
        if factor_ref is not None:
            value = value * factor_ref[...]  # [bm, 1]: global scales, 1 on rows of no group
        # Each row of the tile belongs to exactly one visit (the tail's included), so the rows of
        # other groups keep what the block holds (uninitialized before their own visit).
        out_ref[...] = jnp.where(in_group, value.astype(st.out_dtype), out_ref[...])


def _check_tiles(lhs: Lhs, rhs: PackedFP4Weights, block_m, block_n, block_k) -> None:
    """ValueError for tiles off Mosaic's grid, NotImplementedError for shapes they cannot cover."""
    quantized = isinstance(lhs, fp4.QTensor)
    row_tile = BYTE_ROWS if quantized else BF16_ROWS
    checks = (("block_m", block_m, row_tile), ("block_n", block_n, LANES))
    for name, value, multiple in (*checks, ("block_k", block_k, 2 * LANES)):
        if not isinstance(value, int) or value <= 0 or value % multiple:
            why = "uint8 code tiles" if name == "block_m" and quantized else "TPU vreg tiles"
            raise ValueError(
                f"{name} must be a positive multiple of {multiple} ({why}), got {value!r}"
            )
    for fmt in (rhs.fmt, lhs.fmt if quantized else None):
        if fmt is not None and block_k % fmt.block_size:
            raise ValueError(
                f"block_k={block_k} must be a multiple of the {fmt.name} block size "
                f"{fmt.block_size}"
            )
    _, n, k = rhs.shape
    for name, value, dim, dim_name in (("block_n", block_n, n, "N"), ("block_k", block_k, k, "K")):
        if dim % value:
            raise NotImplementedError(
                f"the Mosaic FP4 MoE matmul needs {dim_name}={dim} to be a multiple of "
                f"{name}={value}"
            )


def fp4_moe_matmul_mosaic(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 256,
    interpret: pltpu.InterpretParams | None = None,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """Grouped `lhs [M, K] x rhs [G, N, K] -> [M, N]` (ragged_dot contract) in one Pallas call,
    lowered by Mosaic for a TPU.

    Args:
      lhs: bfloat16 `[M, K]` or a `QTensor` `[M, K]` (MXFP4, NVFP4 or MXFP8, blocks along K).
      rhs: packed FP4 weights `[G, N, K]`.
      group_sizes: int32 `[G]`, `sum(group_sizes) <= M`; rows past the sum give 0.
      block_m: row tile, a multiple of 16 (32 with quantized activations); lowered to M rounded
        up to that multiple when M is smaller.
      block_n: N tile, a multiple of 128 dividing N.
      block_k: K step, a multiple of 256 and of the formats' block sizes, dividing K.
      interpret: None compiles for a TPU; `pltpu.InterpretParams()` runs the kernel with TPU
        semantics on the CPU.
      out_dtype: output dtype (float32 accumulation either way).

    Raises:
      ValueError: bad operands (`reference.check_operands`) or tiles off Mosaic's grid.
      NotImplementedError: N or K not a multiple of block_n or block_k (so an implementation
        order moves on).
    """
    m, _, n, _ = check_operands(lhs, rhs, group_sizes)
    _check_tiles(lhs, rhs, block_m, block_n, block_k)
    out_dtype = jnp.dtype(out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    row_tile = BYTE_ROWS if isinstance(lhs, fp4.QTensor) else BF16_ROWS
    block_m = min(block_m, _round_up(m, row_tile))
    return _mosaic_call(
        lhs,
        rhs,
        group_sizes,
        tiles=(block_m, block_n, block_k),
        interpret=interpret,
        out_dtype=out_dtype,
    )


def _row_factor(lhs: Lhs, rhs: PackedFP4Weights, group_sizes: jax.Array, mp: int):
    """float32 `[Mp, 1]`: per row, the product of the float32 scales constant along K (the
    expert's NVFP4 global scale, the activations' NVFP4 row scale); 1 on rows of no group. None
    when neither operand has one."""
    lhs_global = isinstance(lhs, fp4.QTensor) and lhs.fmt.has_global_scale
    if not (lhs_global or rhs.fmt.has_global_scale):
        return None
    m, g = lhs.shape[0], rhs.shape[0]
    factor = jnp.ones((m,), jnp.float32)
    ends = group_row_bounds(group_sizes, m)[1 : g + 1]  # [G], clipped to M
    rows = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, rows, side="right")  # G on rows of no group
    in_group = row_group < g
    if rhs.fmt.has_global_scale:
        expert_scale = rhs.global_scale.reshape(g)[jnp.minimum(row_group, g - 1)]
        factor = jnp.where(in_group, expert_scale, factor)
    if lhs_global:
        row_scale = jnp.broadcast_to(lhs.global_scale.astype(jnp.float32), (m, 1)).reshape(m)
        factor = jnp.where(in_group, factor * row_scale, factor)
    return pad_rows(factor[:, None], mp)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "out_dtype"))
def _mosaic_call(lhs, rhs, group_sizes, *, tiles, interpret, out_dtype):
    bm, bn, bk = tiles
    m, k = lhs.shape
    g, n, _ = rhs.shape
    mp = _round_up(m, bm)
    lhs_fmt = lhs.fmt if isinstance(lhs, fp4.QTensor) else None
    factor = _row_factor(lhs, rhs, group_sizes, mp)
    st = _Statics(g, k, bm, bn, bk, lhs_fmt, rhs.fmt, factor is not None, out_dtype)
    offsets, group_ids, tile_ids, meta = _visit_plan(group_sizes, m, mp, bm)

    def visit(v, meta):
        return jnp.minimum(v, meta[0] - 1)  # past the real visits: the last one's blocks

    def lhs_index(j, v, kk, offsets, group_ids, tile_ids, meta):
        v = visit(v, meta)
        tail = group_ids[v] >= g
        return tile_ids[v], jnp.where(tail, st.k_steps - 1, kk)

    def row_index(j, v, kk, offsets, group_ids, tile_ids, meta):
        return tile_ids[visit(v, meta)], 0

    def weight_index(j, v, kk, offsets, group_ids, tile_ids, meta):
        v = visit(v, meta)
        tail = group_ids[v] >= g  # keep the previous visit's (last real group's) last K block
        expert = jnp.where(tail, meta[1], group_ids[v])
        return expert, j, jnp.where(tail, st.k_steps - 1, kk)

    def weight_row_index(j, v, kk, offsets, group_ids, tile_ids, meta):
        expert, j, _ = weight_index(j, v, kk, offsets, group_ids, tile_ids, meta)
        return expert, j, 0

    def out_index(j, v, kk, offsets, group_ids, tile_ids, meta):
        return tile_ids[visit(v, meta)], j

    def even_odd(a):  # [M, K] -> its even and odd columns, [Mp, K / 2] each
        pairs = a.reshape(m, k // 2, 2)
        return [pad_rows(pairs[..., 0], mp), pad_rows(pairs[..., 1], mp)]

    plane_spec = pl.BlockSpec((bm, bk // 2), lhs_index)
    if lhs_fmt is None:
        operands, in_specs = even_odd(lhs), [plane_spec] * 2
    else:
        operands = [*even_odd(lhs.codes), pad_rows(scale_bits(lhs.scales), mp)]
        in_specs = [plane_spec] * 2 + [pl.BlockSpec((bm, k // lhs_fmt.block_size), row_index)]
    operands += [rhs.codes, scale_bits(rhs.scales)]
    in_specs += [
        pl.BlockSpec((None, bn, bk // 2), weight_index),
        pl.BlockSpec((None, bn, k // rhs.fmt.block_size), weight_row_index),
    ]
    if factor is not None:
        operands.append(factor)
        in_specs.append(pl.BlockSpec((bm, 1), row_index))
    scratch = [
        pltpu.VMEM((bm, bn), jnp.float32),
        pltpu.VMEM((bn, _scale_width(k, rhs.fmt)), jnp.bfloat16),
    ]
    if lhs_fmt is not None:
        scratch.append(pltpu.VMEM((bm, _scale_width(k, lhs_fmt)), jnp.bfloat16))
    num_visits = group_ids.shape[0]  # static: the most any group sizes need
    out = pl.pallas_call(
        functools.partial(_kernel, st=st),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(n // bn, num_visits, st.k_steps),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((bm, bn), out_index),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret if interpret is not None else False,
        name="fp4_moe_matmul_mosaic",
    )(offsets, group_ids, tile_ids, meta, *operands)
    return out[:m]
