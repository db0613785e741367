"""Grouped (ragged) matmul of expert-sorted rows: `jax.lax.ragged_dot`, a tiled XLA form, or the
Pallas kernel.

`ragged_dot(lhs [M, K], rhs [E, K, N], group_sizes [E])` multiplies rows
`[sum(g[:e]), sum(g[:e + 1]))` of `lhs` by `rhs[e]`. XLA's default GPU lowering of it (where no
cuDNN kernel applies) expands `lhs` into E zero-padded copies and runs one batched dot over all
groups: E times the FLOPs and an `[E, M, ...]` buffer per projection, forward and backward
(openxla/xla PR 45996 describes that default; marin-community/marin PR 5350 measured 54 GiB of
temporaries for it in an MoE train step).

`tiled_ragged_dot` computes the same product with ordinary XLA ops at ~(1 + E * tile / M) times
the exact FLOPs: each group's rows are moved to a tile-aligned offset of a padded buffer of
`M + E * (tile - 1)` rows (rounded up to whole tiles), every tile of `tile` rows takes its
group's weight matrix, and one batched dot `[n_tiles, tile, K] x [n_tiles, K, N]` runs. Rows of a
tile beyond its group are zeros, so no product leaks between groups. Gradients come from XLA's
autodiff of the gathers and the batched dot (the weights' gradient is a segment sum over tiles).
Its memory: the padded rows and one `[n_tiles, K, N]` copy of the gathered weights per
projection.

`pallas` runs the forward through the Pallas grouped matmul (`kernels_pallas.grouped_matmul`:
per (group, N tile) programs that read each active expert's weight tile once per row tile and
never expand over experts; the XLA reference where the kernel cannot tile the shapes) and the
backward through the tiled form's VJP (`jax.custom_vjp`), so training works: its gradients are
exactly the tiled form's. The kernel is the Triton one on an NVIDIA GPU and jax's megablox `gmm`
(Mosaic) on a TPU; elsewhere `pallas` needs interpretation asked for
(`kernels_pallas.common.interpreting`: slow, for tests) and raises
`kernels_pallas.common.PallasUnavailableError` without it.

`auto` picks per call, in `resolve`: `pallas` where Pallas compiles natively (a GPU; a TPU, where
this choice is not measured); elsewhere, statically from the shapes,
the tiled form where the mean group has at least `AUTO_MIN_MEAN_GROUP_ROWS` rows (training and
prefill: there the dense expansion's E-fold work dominates), `ragged_dot` below (decode: few rows
per expert, where the tiled form's weight gather, `n_tiles` >= E weight matrices copied per
projection, and its extra small ops cost more than the small dense expansion). Measured on the
H200 (`small`, one GRPO step): tiled everywhere trains 28% faster but rolls out 32% slower than
`ragged_dot`.

Axis legend: M rows (expert-sorted), K contraction, N output, E groups, P padded rows.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp

from kernels_pallas import common
from kernels_pallas.grouped_matmul import grouped_matmul


class GroupedMatmul(enum.StrEnum):
    """Which grouped matmul routed experts use."""

    RAGGED_DOT = "ragged_dot"
    TILED = "tiled"
    PALLAS = "pallas"
    AUTO = "auto"


# `auto` tiles from this mean group size on: a full default tile (128 rows) per expert, where the
# padding is at most one tile per group and the gathered weights at most ~2 M / 128 matrices.
AUTO_MIN_MEAN_GROUP_ROWS = 128


def resolve(impl: GroupedMatmul | str, m: int, n_groups: int) -> GroupedMatmul:
    """The concrete grouped matmul for M rows over `n_groups` groups; the one place `auto` is
    decided: `pallas` where Pallas compiles natively (`kernels_pallas.common.native_lowering`: a
    GPU or a TPU), elsewhere `tiled` from a mean group of `AUTO_MIN_MEAN_GROUP_ROWS` rows on and
    `ragged_dot` below. Other choices stand."""
    impl = GroupedMatmul(impl)
    if impl is not GroupedMatmul.AUTO:
        return impl
    if common.native_lowering():
        return GroupedMatmul.PALLAS
    tiled = m >= AUTO_MIN_MEAN_GROUP_ROWS * n_groups
    return GroupedMatmul.TILED if tiled else GroupedMatmul.RAGGED_DOT


def default_tile(m: int, n_groups: int) -> int:
    """Rows per tile: the power of two nearest M / E (the mean group), within [8, 128]."""
    mean = max(m // max(n_groups, 1), 1)
    return int(min(128, max(8, 1 << (mean.bit_length() - 1))))


def tiled_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tile: int | None = None,
    preferred_element_type=None,
) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` by tile-aligned groups and one batched dot.

    Args:
      lhs: [M, K], rows sorted by group. rhs: [E, K, N]. group_sizes: int32 [E], sum <= M
        (rows past the sum belong to no group and give zeros, as in `ragged_dot`).
      tile: rows per tile (default `default_tile(M, E)`).
      preferred_element_type: accumulation / output dtype of the dot (default: lhs.dtype, with
        the platform's accumulation).

    Returns: [M, N] in `preferred_element_type or lhs.dtype`.
    """
    m, k = lhs.shape
    e, k2, n = rhs.shape
    if k != k2 or group_sizes.shape != (e,):
        raise ValueError(
            f"tiled_ragged_dot: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
            f"{group_sizes.shape} do not fit [M, K] x [E, K, N] with [E] group sizes"
        )
    tile = tile or default_tile(m, e)
    n_tiles = -(-(m + e * (tile - 1)) // tile)  # static bound on the tiles all groups need
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes  # first row of each group in lhs
    tiles_per_group = (sizes + tile - 1) // tile
    tile_starts = jnp.cumsum(tiles_per_group) - tiles_per_group  # first tile of each group
    # Row i of lhs: its group, its index within the group, its padded slot.
    rows = jnp.arange(m, dtype=jnp.int32)
    group_of_row = jnp.searchsorted(jnp.cumsum(sizes), rows, side="right").astype(jnp.int32)
    in_group = group_of_row < e  # rows past sum(group_sizes) belong to no group
    g = jnp.minimum(group_of_row, e - 1)
    slot = tile_starts[g] * tile + rows - starts[g]
    slot = jnp.where(in_group, slot, n_tiles * tile)  # out of bounds: dropped
    padded = jnp.zeros((n_tiles * tile, k), lhs.dtype).at[slot].set(lhs, mode="drop")
    # Tile j belongs to the group whose tile range holds j (tiles past the last are unused and
    # take any group's weights: their rows are zeros and nobody reads their outputs).
    tile_group = jnp.searchsorted(
        jnp.cumsum(tiles_per_group), jnp.arange(n_tiles, dtype=jnp.int32), side="right"
    )
    w = rhs[jnp.minimum(tile_group, e - 1)]  # [n_tiles, K, N]
    out = jnp.einsum(
        "jtk,jkn->jtn",
        padded.reshape(n_tiles, tile, k),
        w,
        preferred_element_type=preferred_element_type,
    ).reshape(n_tiles * tile, n)
    # A row in no group reads the last padded row: never a group's (the groups fill at most
    # sum(group_sizes) + E * (tile - 1) < n_tiles * tile rows when rows are left over), so zeros.
    return out[jnp.minimum(slot, n_tiles * tile - 1)]


# The kernel where it can tile the shapes, the `ragged_dot` reference where it cannot.
_PALLAS_ORDER = ("pallas", "xla")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def pallas_ragged_dot(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int | None = None
) -> jax.Array:
    """`ragged_dot(lhs [M, K], rhs [E, K, N], group_sizes [E]) -> [M, N]` in lhs.dtype: forward by
    the Pallas grouped matmul, backward by `tiled_ragged_dot`'s VJP (`tile` rows per tile).
    Raises `kernels_pallas.common.PallasUnavailableError` where Pallas neither compiles nor is
    interpreted (`common.pallas_target`)."""
    common.pallas_target()  # rather than a silent fallback to `ragged_dot`
    w = jnp.swapaxes(rhs, -1, -2)  # [E, N, K]: the kernel's layout (the model stores it so)
    return grouped_matmul(lhs, w, group_sizes, implementation=_PALLAS_ORDER, out_dtype=lhs.dtype)


def _pallas_fwd(lhs, rhs, group_sizes, tile):
    return pallas_ragged_dot(lhs, rhs, group_sizes, tile), (lhs, rhs, group_sizes)


def _pallas_bwd(tile, residuals, cotangent):
    lhs, rhs, group_sizes = residuals

    def tiled(a, b):
        return tiled_ragged_dot(a, b, group_sizes, tile=tile).astype(a.dtype)

    _, vjp = jax.vjp(tiled, lhs, rhs)
    d_lhs, d_rhs = vjp(cotangent)
    return d_lhs, d_rhs, None


pallas_ragged_dot.defvjp(_pallas_fwd, _pallas_bwd)


def grouped_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    impl: GroupedMatmul | str = GroupedMatmul.RAGGED_DOT,
) -> jax.Array:
    """The grouped matmul `impl` of `lhs [M, K]` by `rhs [E, K, N]` over `group_sizes [E]`, in
    lhs.dtype."""
    impl = resolve(impl, lhs.shape[0], rhs.shape[0])
    if impl is GroupedMatmul.TILED:
        return tiled_ragged_dot(lhs, rhs, group_sizes).astype(lhs.dtype)
    if impl is GroupedMatmul.PALLAS:
        return pallas_ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
