"""The native block-scaled implementation: `jax.nn.scaled_matmul` over one-group row tiles.

`jax.nn.scaled_matmul` is a dense batched product `[B, T, K] x [B, N, K] -> [B, T, N]` of
block-scaled operands (on a GPU: cuDNN, Blackwell's FP4 tensor cores for NVFP4 x NVFP4; on the
CPU: XLA's decomposition). The ragged grouped product becomes a batch of row tiles: every group's
rows are cut into tiles of `tile` rows (its last tile padded), each tile is paired with its
group's weights, and the results are scattered back to their rows. There are at most
`cdiv(M, tile) + G` tiles (each group adds at most one partial tile), a static batch size; padding
rows read a zero row and are dropped. Compute grows with the padding (G * tile rows at most), the
price of a dense library call on ragged data; `default_tile` keeps tiles near the mean group size.

Block scales enter the library as they are; the NVFP4 global scales (a per-row activation scale,
a per-expert weight scale) are applied to the float32 result. So the result equals the XLA
reference up to float32 summation order.

Where it runs: CPU (the tests compare it with the reference there) and GPUs of compute capability
>= 10 for NVFP4 x NVFP4. NOT run on a Blackwell GPU in this project (none was available): its
speed and its cuDNN lowering are unverified. On other GPUs, and for operand pairs cuDNN lacks
(bfloat16 activations, W4A8, MXFP4), it raises NotImplementedError and "auto" moves on to Pallas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.fp4_moe_matmul.reference import Lhs, PackedFP4Weights
from trace_jax import fp4
from trace_jax.fp4 import numerics


def default_tile(m: int, groups: int) -> int:
    """Rows per tile: the mean group size as a power of two, within [16, 128]."""
    return int(min(128, max(16, pl.next_power_of_2(max(1, m // max(groups, 1))))))


def tile_plan(group_sizes: jax.Array, m: int, tile: int) -> tuple[jax.Array, jax.Array]:
    """Row tiles of the groups.

    Returns:
      rows: int32 `[B, tile]`, B = cdiv(M, tile) + G: the lhs row of each tile slot, or M (a
        padding slot) where the tile runs past its group or the tile is unused.
      tile_group: int32 `[B]`: the group of each tile (clipped to G - 1 for unused tiles).
    """
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts  # clipped to M
    tiles = (sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)
    b = pl.cdiv(m, tile) + g
    ids = jnp.arange(b, dtype=jnp.int32)
    group = jnp.searchsorted(tile_ends, ids, side="right").astype(jnp.int32)
    used = group < g
    group = jnp.minimum(group, g - 1)
    first_tile = tile_ends[group] - tiles[group]
    rows = starts[group, None] + (ids - first_tile)[:, None] * tile + jnp.arange(tile)[None, :]
    valid = used[:, None] & (rows < ends[group, None])
    return jnp.where(valid, rows, m).astype(jnp.int32), group


def _as_library_operand(codes: jax.Array, fmt: fp4.BlockFormat) -> jax.Array:
    """Element codes (uint8, one per byte) -> the float4_e2m1fn / float8_e4m3fn array the library
    takes (exact: every code's value is representable)."""
    dtype = jnp.float4_e2m1fn if fmt.is_fp4 else jnp.float8_e4m3fn  # MXFP8: E4M3 elements
    return numerics.decode(codes, fmt.elem).astype(dtype)


def supported_on_gpu(lhs: Lhs, rhs: PackedFP4Weights) -> bool:
    """cuDNN's block-scaled matmul takes NVFP4 x NVFP4 (and MXFP8 x MXFP8, not an FP4 case)."""
    return isinstance(lhs, fp4.QTensor) and lhs.fmt == fp4.NVFP4 and rhs.fmt == fp4.NVFP4


@functools.partial(jax.jit, static_argnames=("tile", "out_dtype"))
def scaled_matmul_grouped(
    lhs: fp4.QTensor,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    tile: int,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """`lhs [M, K] x rhs [G, N, K] -> [M, N]` (ragged_dot contract) through `scaled_matmul`.

    lhs: a block-scaled `QTensor` (NVFP4, MXFP4 or MXFP8, blocks along K); rhs: packed FP4.
    """
    m = lhs.shape[0]
    n = rhs.shape[1]
    rows, tile_group = tile_plan(group_sizes, m, tile)

    def padded(a):  # one zero row at index M for the padding slots
        return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])

    a = padded(_as_library_operand(lhs.codes, lhs.fmt))[rows]  # [B, T, K]
    a_scales = padded(lhs.scales)[rows]  # [B, T, K / block]
    w = _as_library_operand(fp4.unpack_fp4(rhs.codes), rhs.fmt)[tile_group]  # [B, N, K]
    w_scales = rhs.scales[tile_group]
    out = jax.nn.scaled_matmul(a, w, a_scales, w_scales, preferred_element_type=jnp.float32)
    if rhs.global_scale is not None:
        out = out * rhs.global_scale[tile_group]  # [B, 1, 1]
    if lhs.global_scale is not None:
        row_scale = jnp.broadcast_to(lhs.global_scale.astype(jnp.float32), (m, 1))
        out = out * padded(row_scale)[rows]  # [B, T, 1]
    flat = jnp.zeros((m + 1, n), jnp.float32).at[rows.reshape(-1)].set(out.reshape(-1, n))
    return flat[:m].astype(out_dtype)
