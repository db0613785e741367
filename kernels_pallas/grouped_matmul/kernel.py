"""Pallas grouped matmul of bf16 operands (Triton lowering on a GPU), and the group-major program
driver it shares with the FP4 MoE kernel (`kernels_pallas.fp4_moe_matmul`).

Axis legend: M rows of lhs (sorted by group), K contraction, N outputs, G groups (experts).

Design (`group_major_call`). The grid is (N / block_n, G + 1). Program (j, g) owns output columns
`[j * block_n, (j + 1) * block_n)` of group g's rows `[bounds[g], bounds[g + 1])` and walks them
in row tiles of `block_m`; for each tile an op's `tile_product` hook returns the float32
`[block_m, block_n]` product (here: a K loop of bf16 dots; the FP4 kernel decodes its packed
weights in the same hook), which the driver stores. Program g = G owns the tail, rows
`[sum(group_sizes), M)` that belong to no group, and writes zeros there. So:
  * every output element is written exactly once: no zero-filled output buffer, no scatter;
  * an empty group's programs exit at once, and each active expert's weight tile is read once
    per row tile of its group (a group of 3 rows at decode costs one row tile, not E of them as in
    XLA's dense expansion of `ragged_dot`);
  * N tiles are the fast grid axis (CUDA's x): the programs that share a group's rows run side by
    side and share those rows through L2; with groups fast, all of lhs would be read N / block_n
    times from memory at prefill.
Row windows: a tile starts at its group's first row plus a multiple of `block_m`; a window that
would run past the last row is moved back to end there and the rows before the tile's own are
masked out of the store. Every load and store stays inside the arrays (interpret mode clamps
out-of-range windows instead of masking them), so lhs needs no padding copy; only M < block_m pads
lhs to `block_m` rows. The product of a row depends on that row alone, so the bf16 kernel loads
whole windows without masks (rows of other groups give products nobody stores).

Numerics: bf16 (or float16) products are exact in float32 and accumulate in float32, in K order
per `block_k` chunk; float32 operands take IEEE float32 dots (`Precision.HIGHEST`; Triton's TF32
otherwise). So kernel and `ragged_dot` at HIGHEST precision differ by float32 summation order only.

Hopper-specific: `default_block_config`'s tiles and stages (H200 sweep; 16-deep K steps). A
Blackwell run should check first the tests' tolerances on the device, then re-sweep the tiles (148
SMs on a B200). On a TPU the api runs jax's megablox `gmm` instead (Mosaic).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import triton_params
from kernels_pallas.grouped_matmul.reference import check_operands

MIN_DOT_DIM = 16  # Triton's smallest tensor-core tile edge for 16-bit `tl.dot`.

# `tile_product(in_refs, g, rows, in_tile) -> float32 [block_m, block_n]`: the product of the row
# window `rows` (a `pl.ds` of block_m rows) of group g with the program's N tile; `in_tile` bool
# [block_m] marks the window's rows that belong to this tile.
TileProduct = Callable[[Sequence, jax.Array, pl.Slice, jax.Array], jax.Array]


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Tiles (powers of two >= 16) and Triton launch parameters of the bf16 kernel.

    The class defaults are one fixed choice; `default_block_config` picks per shape."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or not is_pow2(value) or value < MIN_DOT_DIM:
                raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}, got {value!r}")
        if not isinstance(self.num_warps, int) or not is_pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")


def fit_block(block: int, dim: int, name: str, least: int = MIN_DOT_DIM) -> int:
    """`block` halved until it divides `dim` (a power of two, at least `least`).

    Raises NotImplementedError when none does (the api then falls back to XLA)."""
    block = min(block, max(least, pl.next_power_of_2(dim)))
    while block >= least:
        if dim % block == 0:
            return block
        block //= 2
    raise NotImplementedError(f"pallas: no power-of-two {name} >= {least} divides {dim}")


def row_tile(m: int, g: int, cap: int) -> int:
    """Rows per tile for M rows over G groups: 1.5 x the mean group size as a power of two, within
    [MIN_DOT_DIM, cap]. Random routing spreads group sizes around the mean; a tile that holds most
    groups whole reads each weight tile once per group (H200, 8192 rows over 128 experts, bf16:
    128-row tiles 0.13 ms, 64-row tiles 0.18 ms; `kernels_moe_matmul.json` of commit 75f6f28, the
    full tile sweep)."""
    rows = pl.cdiv(3 * m, 2 * max(g, 1))
    return int(min(cap, max(MIN_DOT_DIM, pl.next_power_of_2(max(1, rows)))))


def default_block_config(m: int, g: int, k: int, n: int, *, itemsize: int = 2) -> BlockConfig:
    """Tiles for M rows over G groups, `[M, K] x [G, N, K]`, from the H200 sweep
    (`experiments/results/kernels_moe_matmul.json` of commit 75f6f28, G = 128, K = 2048,
    N = 768).

    Decode (a few rows per group, 16-row tiles): 64 x 128 weight tiles, four load stages: the
    phase reads the weights once, and deep pipelining keeps bytes in flight (1.1-1.3x the byte
    limit at 512 rows; the decode tilings spread over 20% and swap ranks from run to run).
    Prefill: 128-column tiles, 64-deep K steps, row tiles of `row_tile` up to 256 (8 warps from
    128 rows on, four load stages at 256; 60% of the dense bf16 rate at 65536 rows). Operands of
    `itemsize` 4 (float32) take half the K step and at most three stages: the shared memory per
    load stage of the 2-byte tiles (every default tile of 2-byte operands ran in those sweeps;
    float32 ones have not run on a GPU). block_n and block_k shrink to divide N and K
    (NotImplementedError if no power of two >= 16 does)."""
    block_m = row_tile(m, g, 256)
    if block_m <= 32:  # decode
        block_n, block_k, num_warps, num_stages = 64, 128, 4, 4
    else:
        block_n, block_k, num_warps = 128, 64, 8 if block_m >= 128 else 4
        num_stages = 4 if block_m >= 256 else 3
    if itemsize > 2:  # float32: the shared memory per stage of the 2-byte tiles, fewer stages
        block_k, num_stages = max(MIN_DOT_DIM, block_k // 2), min(num_stages, 3)
    return BlockConfig(
        block_m=block_m,
        block_n=fit_block(block_n, n, "block_n"),
        block_k=fit_block(block_k, k, "block_k"),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def check_tiling(config: BlockConfig, k: int, n: int) -> None:
    """Raises ValueError unless block_n divides N and block_k divides K."""
    if n % config.block_n:
        raise ValueError(f"block_n={config.block_n} must divide N={n}")
    if k % config.block_k:
        raise ValueError(f"block_k={config.block_k} must divide K={k}")


def group_row_bounds(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 `[G + 2]`: group g < G owns rows `[b[g], b[g + 1])` (clipped to M); the tail, rows in
    no group, is `[b[G], b[G + 1] = M)`."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    zero, last = jnp.zeros((1,), jnp.int32), jnp.full((1,), m, jnp.int32)
    return jnp.concatenate([zero, ends, last])


def padded_rows(m: int, block_m: int) -> int:
    """Rows of the arrays a group-major call reads: M, or block_m when M is smaller (one window
    must fit)."""
    return max(m, block_m)


def pad_rows(a: jax.Array, rows: int) -> jax.Array:
    """`a` with zero rows appended up to `rows` (itself when it has them)."""
    if a.shape[0] == rows:
        return a
    return jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def _group_major_kernel(bounds_ref, *refs, tile_product, n_groups, rows_total, bm, bn, out_dtype):
    in_refs, out_ref = refs[:-1], refs[-1]
    g = pl.program_id(1)
    lo = bounds_ref[g]
    hi = bounds_ref[g + 1]

    def window(t):
        row0 = lo + t * bm
        start = jnp.minimum(row0, rows_total - bm)  # moved back to end inside the arrays
        r = start + jnp.arange(bm, dtype=jnp.int32)
        return pl.ds(start, bm), (r >= row0) & (r < hi)

    def store(rows, in_tile, value):
        mask = jnp.broadcast_to(in_tile[:, None], (bm, bn))
        plgpu.store(out_ref.at[rows, :], value.astype(out_dtype), mask=mask)

    def tile_loop(body):
        def step(t, carry):
            rows, in_tile = window(t)
            store(rows, in_tile, body(rows, in_tile))
            return carry

        jax.lax.fori_loop(0, pl.cdiv(hi - lo, bm), step, 0)

    @pl.when(g < n_groups)
    def _():
        tile_loop(lambda rows, in_tile: tile_product(in_refs, g, rows, in_tile))

    @pl.when(g == n_groups)
    def _():
        tile_loop(lambda rows, in_tile: jnp.zeros((bm, bn), jnp.float32))


def group_major_call(
    tile_product: TileProduct,
    operands: Sequence[jax.Array],
    in_specs: Sequence[pl.BlockSpec],
    group_sizes: jax.Array,
    *,
    rows_total: int,
    n: int,
    config: BlockConfig,
    out_dtype: jnp.dtype,
    interpret: bool,
    name: str,
) -> jax.Array:
    """One Pallas call on the (N / block_n, G + 1) grid (see the module docstring).

    operands, in_specs: the op's inputs; their index maps take the program ids `(j, g)` (g = G is
    the tail program, which reads nothing). Row-indexed operands hold `rows_total` rows
    (`padded_rows`). config: block_m, block_n, num_warps and num_stages are read (this module's
    `BlockConfig` or the FP4 kernel's). Returns `[rows_total, n]` in `out_dtype`.
    """
    block_m, block_n = config.block_m, config.block_n
    n_groups = group_sizes.shape[0]
    bounds = group_row_bounds(group_sizes, rows_total)
    kernel = functools.partial(
        _group_major_kernel,
        tile_product=tile_product,
        n_groups=n_groups,
        rows_total=rows_total,
        bm=block_m,
        bn=block_n,
        out_dtype=out_dtype,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows_total, n), out_dtype),
        grid=(n // block_n, n_groups + 1),
        in_specs=[pl.BlockSpec((n_groups + 2,), lambda j, g: (0,)), *in_specs],
        out_specs=pl.BlockSpec((rows_total, block_n), lambda j, g: (0, j)),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name=name,
    )(bounds, *operands)


def dot_tile_product(in_refs, g, rows, in_tile, *, k, block_k, precision):
    """lhs rows `rows` x expert g's N tile: a K loop of dots, float32 `[block_m, block_n]`; the
    bf16 kernel's `TileProduct` (`in_refs` = lhs, rhs), also under the FP4 matmul's predecoded
    weights (`kernels_pallas.fp4_moe_matmul.predecoded`)."""
    del in_tile  # rows outside the tile are computed and dropped at the store
    lhs_ref, rhs_ref = in_refs
    bm, bn = rows.size, rhs_ref.shape[1]

    def k_step(kk, acc):
        cols = pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)
        a = lhs_ref[rows, cols]  # [bm, bk]
        w = rhs_ref[g, :, cols]  # [bn, bk]: K contiguous, as stored
        return acc + jax.lax.dot_general(
            a, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    return jax.lax.fori_loop(0, k // block_k, k_step, jnp.zeros((bm, bn), jnp.float32))


def grouped_matmul_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    config: BlockConfig = BlockConfig(),
    interpret: bool = False,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Grouped `lhs [M, K] x rhs [G, N, K] -> [M, N]` (the `ragged_dot` contract), one Pallas call.

    Args:
      lhs: `[M, K]` bfloat16 (float16, float32), rows sorted by group.
      rhs: `[G, N, K]`, lhs's dtype (contraction last, like the model's expert weights).
      group_sizes: int32 `[G]`, `sum(group_sizes) <= M`; rows past the sum give 0.
      config: tiles (block_n must divide N, block_k must divide K) and Triton launch parameters.
      interpret: run in Pallas interpret mode (CPU tests).
      out_dtype: output dtype (default lhs.dtype); float32 accumulation either way.
    """
    m, k, n, _ = check_operands(lhs, rhs, group_sizes)
    check_tiling(config, k, n)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    return _pallas_call(
        lhs, rhs, group_sizes, config=config, interpret=interpret, out_dtype=out_dtype
    )


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def _pallas_call(lhs, rhs, group_sizes, *, config, interpret, out_dtype):
    m, k = lhs.shape
    g, n, _ = rhs.shape
    rows_total = padded_rows(m, config.block_m)
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    tile_product = functools.partial(
        dot_tile_product, k=k, block_k=config.block_k, precision=precision
    )
    out = group_major_call(
        tile_product,
        [pad_rows(lhs, rows_total), rhs],
        [
            pl.BlockSpec((rows_total, k), lambda j, gi: (0, 0)),
            pl.BlockSpec((g, config.block_n, k), lambda j, gi: (0, j, 0)),
        ],
        group_sizes,
        rows_total=rows_total,
        n=n,
        config=config,
        out_dtype=out_dtype,
        interpret=interpret,
        name="grouped_matmul",
    )
    return out[:m]
