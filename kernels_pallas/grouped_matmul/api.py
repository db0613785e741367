"""`grouped_matmul`: the op's one public interface; tries implementations in order, moving on at
NotImplementedError, the XLA reference last.

Implementations (`kernels_pallas.common.Implementation`): "pallas" (`kernel.grouped_matmul_pallas`,
Triton on a GPU, interpret mode elsewhere; NotImplementedError where no power-of-two tile >= 16
divides N or K) and "xla" (`reference.grouped_matmul_reference`, `jax.lax.ragged_dot`). The
default (`implementation=None`) is ("pallas", "xla") on a GPU and the reference alone elsewhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
    interpret: bool | None = None,
    out_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, common.Implementation]:
    """`grouped_matmul` (same arguments) that also returns the implementation that ran."""
    m, k, n, g = check_operands(lhs, rhs, group_sizes)
    order = common.implementation_order(implementation)
    interpret = common.interpret_mode(interpret)
    tiling = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )

    def run_pallas():
        config = block_config(m, g, k, n, dtype=lhs.dtype, **tiling)
        return grouped_matmul_pallas(
            lhs, rhs, group_sizes, config=config, interpret=interpret, out_dtype=out_dtype
        )

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
    interpret: bool | None = None,
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
      block_m, block_n, block_k: Pallas tiles (powers of two >= 16); num_warps, num_stages: Triton
        launch parameters. None: `kernel.default_block_config` for these shapes.
      interpret: Pallas interpret mode; None: on unless running on a GPU.
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
