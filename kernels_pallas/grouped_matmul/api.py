"""`grouped_matmul`: the op's one public interface; tries implementations in order, moving on at
NotImplementedError, the XLA reference last.

Implementations (`kernels_pallas.common.Implementation`): "pallas" and "xla"
(`reference.grouped_matmul_reference`, `jax.lax.ragged_dot`). The Pallas kernel
(`common.pallas_target`): `kernel.grouped_matmul_pallas` through Triton (an NVIDIA GPU, or
interpret=True; NotImplementedError where no power-of-two tile >= 16 divides N or K), or jax's
own TPU grouped matmul, megablox `gmm`, through Mosaic (a TPU, or interpret=
`pltpu.InterpretParams()`; bfloat16 and float32 operands, NotImplementedError for float16). The
default (`implementation=None`) is ("pallas", "xla") where Pallas compiles natively (a GPU, a TPU)
and the reference alone elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

from kernels_pallas import common
from kernels_pallas.grouped_matmul.kernel import (
    BlockConfig,
    check_tiling,
    default_block_config,
    grouped_matmul_pallas,
)
from kernels_pallas.grouped_matmul.reference import check_operands, grouped_matmul_reference


def block_config(
    m: int,
    g: int,
    k: int,
    n: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
) -> BlockConfig:
    """The Pallas tiling for `[M, K] x [G, N, K]` operands of `dtype`: given values as they are
    (ValueError if they do not tile N and K), the rest from `default_block_config`."""
    given = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if any(value is None for value in given.values()):
        itemsize = jnp.dtype(dtype).itemsize
        defaults = dataclasses.asdict(default_block_config(m, g, k, n, itemsize=itemsize))
        given = {f: defaults[f] if value is None else value for f, value in given.items()}
    config = BlockConfig(**given)
    check_tiling(config, k, n)
    return config


# megablox's default tiles (rows, contraction, columns), the largest it is given; not tuned here.
MEGABLOX_TILE = (128, 128, 128)
_LANES = 128  # a Mosaic block's last dimension: a multiple of the 128 lanes, or the whole axis


def megablox_tiling(
    m: int,
    k: int,
    n: int,
    dtype: jnp.dtype,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> tuple[int, int, int]:
    """megablox `gmm` tiles `(tm, tk, tn)` for `[M, K] x [G, N, K]` operands of `dtype`: given
    values as they are, the rest MEGABLOX_TILE's capped at the operand (M rounded up to whole
    sublane tiles). ValueError for tiles Mosaic cannot lay out (block_m not a multiple of the
    dtype's sublane tile; block_n, block_k neither a multiple of 128 nor the whole axis)."""
    sublanes = 8 * 4 // jnp.dtype(dtype).itemsize  # float32: 8, 16-bit: 16
    default_m, default_k, default_n = MEGABLOX_TILE
    tm = block_m or min(default_m, max(sublanes, -(-m // sublanes) * sublanes))
    tk = block_k or (k if k <= default_k else default_k)
    tn = block_n or (n if n <= default_n else default_n)
    if tm % sublanes:
        raise ValueError(f"block_m={tm} must be a multiple of {sublanes} for {jnp.dtype(dtype)}")
    for name, tile, size in (("block_k", tk, k), ("block_n", tn, n)):
        if tile != size and tile % _LANES:
            raise ValueError(f"{name}={tile} must be a multiple of {_LANES} or equal {size}")
    return tm, tk, tn


def grouped_matmul_megablox(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiling: tuple[int, int, int],
    interpret: common.Interpret = None,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`grouped_matmul` by megablox `gmm` (Mosaic): lhs `[M, K]` padded to whole `tiling[0]` row
    tiles, `rhs [G, N, K]` read transposed in place, float32 accumulation; megablox leaves rows
    past `sum(group_sizes)` unwritten, so they are zeroed here. `interpret`: None (compiled for a
    TPU) or `pltpu.InterpretParams`."""
    m, _, n, _ = check_operands(lhs, rhs, group_sizes)
    out_dtype = out_dtype or lhs.dtype
    if lhs.dtype == jnp.float16:
        raise NotImplementedError("megablox gmm takes bfloat16 or float32 operands, got float16")
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    tm = tiling[0]
    padded = -(-m // tm) * tm
    out = megablox.gmm(
        jnp.pad(lhs, ((0, padded - m), (0, 0))),
        rhs,
        group_sizes,
        jnp.float32,
        tiling,
        transpose_rhs=True,
        interpret=interpret or False,
    )
    in_group = jnp.arange(padded, dtype=jnp.int32)[:, None] < jnp.sum(group_sizes)
    return jnp.where(in_group, out, 0.0)[:m].astype(out_dtype)


def grouped_matmul_with_implementation(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: common.ImplementationLike = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: common.Interpret = None,
    out_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, common.Implementation]:
    """`grouped_matmul` (same arguments) that also returns the implementation that ran."""
    m, k, n, g = check_operands(lhs, rhs, group_sizes)
    order = common.implementation_order(implementation)
    tiling = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )

    def run_pallas():
        target = common.pallas_target(interpret)
        if target.lowering is common.Lowering.MOSAIC:
            tiles = megablox_tiling(
                m, k, n, lhs.dtype, block_m=block_m, block_n=block_n, block_k=block_k
            )
            matmul = functools.partial(grouped_matmul_megablox, tiling=tiles)
        else:
            config = block_config(m, g, k, n, dtype=lhs.dtype, **tiling)
            matmul = functools.partial(grouped_matmul_pallas, config=config)
        # GSPMD cannot partition a Pallas call (Mosaic or Triton); the groups span all rows, so
        # on a mesh each device runs the whole op.
        matmul = functools.partial(matmul, interpret=target.interpret, out_dtype=out_dtype)
        return common.per_device(matmul, lhs, rhs, group_sizes)

    def run_xla():
        return grouped_matmul_reference(lhs, rhs, group_sizes, out_dtype=out_dtype)

    runners = {common.Implementation.PALLAS: run_pallas, common.Implementation.XLA: run_xla}
    return common.run_first(order, runners)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: common.ImplementationLike = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: common.Interpret = None,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Grouped matmul `lhs [M, K] x rhs [G, N, K] -> [M, N]`, the `jax.lax.ragged_dot` contract.

    Args:
      lhs: bfloat16 `[M, K]` (float16 and float32 are taken too), rows sorted by group.
      rhs: `[G, N, K]` in lhs's dtype: contraction last, the layout of the model's expert weights
        (`reference.py` says why).
      group_sizes: int32 `[G]`; rows are grouped contiguously, `sum(group_sizes) <= M`, rows past
        the sum give 0.
      implementation: None | "pallas" | "xla", or a sequence of them (the module docstring).
      block_m, block_n, block_k: Pallas tiles (Triton: powers of two >= 16, None:
        `kernel.default_block_config`; megablox: `megablox_tiling`); num_warps, num_stages:
        Triton launch parameters (ignored by megablox).
      interpret: None (native, or the `common.interpreting` context's choice), True (the Triton
        kernel interpreted) or `pltpu.InterpretParams` (megablox interpreted); see
        `common.pallas_target`.
      out_dtype: output dtype (default lhs.dtype); every implementation accumulates in float32.

    Not differentiable by itself (no custom_vjp); `trace_jax.models.grouped_matmul` pairs it with
    the tiled XLA form's gradient.
    """
    out, _ = grouped_matmul_with_implementation(
        lhs,
        rhs,
        group_sizes,
        implementation=implementation,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        out_dtype=out_dtype,
    )
    return out
