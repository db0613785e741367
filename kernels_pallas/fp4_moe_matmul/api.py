"""`fp4_moe_matmul`: the op's one public interface; tries implementations in order, moving on
at NotImplementedError, the XLA reference last.

Implementations, in the order the default (`implementation=None`) tries them on a GPU:
  * "scaled_matmul" (GPUs of compute capability >= 10, NVFP4 x NVFP4; and the CPU, where tests
    run it): `jax.nn.scaled_matmul` over per-group row tiles (`scaled.py`); NOT run on a
    Blackwell GPU here (none available), so its cuDNN lowering and speed are unverified.
  * "pallas": `kernel.fp4_moe_matmul_pallas`, Triton on a GPU, interpret mode elsewhere.
  * "xla": `reference.fp4_moe_matmul_reference`.
The default off a GPU is the reference alone (`kernels_pallas.common.implementation_order`). A
named implementation runs alone and its errors propagate; a sequence of names is tried in order.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import common
from kernels_pallas.fp4_moe_matmul import scaled
from kernels_pallas.fp4_moe_matmul.kernel import (
    BlockConfig,
    check_tiling,
    fp4_moe_matmul_pallas,
    lhs_format,
)
from kernels_pallas.fp4_moe_matmul.reference import (
    Lhs,
    PackedFP4Weights,
    check_operands,
    fp4_moe_matmul_reference,
)
from trace_jax import fp4

_DEFAULTS = BlockConfig()
_MIN_BLOCK = 16


class MoEImplementation(enum.StrEnum):
    """The implementations of `fp4_moe_matmul` (`kernels_pallas.common.Implementation` plus
    cuDNN's block-scaled matmul)."""

    SCALED_MATMUL = "scaled_matmul"
    PALLAS = "pallas"
    XLA = "xla"


def _compute_capability() -> float:
    """The default GPU's compute capability (e.g. 9.0 on an H200), 0.0 off a GPU."""
    if not common.on_gpu():
        return 0.0
    try:
        return float(jax.devices()[0].compute_capability)
    except (AttributeError, TypeError, ValueError):
        return 0.0


def _pick_block(requested: int | None, default: int, dim: int, multiple: int, name: str) -> int:
    """A requested block is used as is; the default shrinks (powers of two) until it divides dim.

    Raises NotImplementedError when no default fits (the caller may fall back to XLA).
    """
    if requested is not None:
        return requested
    block = min(default, max(_MIN_BLOCK, pl.next_power_of_2(dim)))
    while block >= max(_MIN_BLOCK, multiple):
        if dim % block == 0 and block % multiple == 0:
            return block
        block //= 2
    raise NotImplementedError(
        f"pallas: no power-of-two {name} >= {max(_MIN_BLOCK, multiple)} divides {dim}"
    )


def block_config(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = _DEFAULTS.num_warps,
    num_stages: int = _DEFAULTS.num_stages,
    grid: str = _DEFAULTS.grid,
) -> BlockConfig:
    """The Pallas tiling for these operands: given blocks are checked (ValueError), missing ones
    default to 64 and shrink to fit (block_m to M, or with the "groups" grid to the mean group
    size M / G; block_n to divide N, block_k to divide K)."""
    m = lhs.shape[0]
    g, n, k = rhs.shape
    fmt_blocks = [f.block_size for f in (rhs.fmt, lhs_format(lhs)) if f is not None]
    if block_m is None:
        rows = pl.cdiv(m, g) if grid == "groups" else m
        block_m = min(_DEFAULTS.block_m, max(_MIN_BLOCK, pl.next_power_of_2(rows)))
    config = BlockConfig(
        block_m=block_m,
        block_n=_pick_block(block_n, _DEFAULTS.block_n, n, 1, "block_n"),
        block_k=_pick_block(block_k, _DEFAULTS.block_k, k, max(fmt_blocks), "block_k"),
        num_warps=num_warps,
        num_stages=num_stages,
        grid=grid,
    )
    check_tiling(config, lhs, rhs)
    return config


def _run_scaled_matmul(lhs, rhs, group_sizes, *, tiling, interpret, out_dtype):
    """Native block-scaled matmul through `jax.nn.scaled_matmul` (see `scaled.py`).

    Runs on the CPU (XLA's decomposition; how it is tested) and on GPUs of compute capability
    >= 10 for NVFP4 x NVFP4; raises NotImplementedError elsewhere so that "auto" moves on.
    """
    del interpret
    if not isinstance(lhs, fp4.QTensor):
        raise NotImplementedError(
            "scaled_matmul implementation needs block-scaled (QTensor) activations"
        )
    if lhs.fmt.block_size != rhs.fmt.block_size:
        raise NotImplementedError(
            f"scaled_matmul implementation needs equal scale blocks, got {lhs.fmt.name} "
            f"({lhs.fmt.block_size}) x {rhs.fmt.name} ({rhs.fmt.block_size})"
        )
    if common.on_gpu():
        if _compute_capability() < 10:
            raise NotImplementedError(
                "scaled_matmul implementation needs a GPU of compute capability >= 10 (Blackwell)"
            )
        if not scaled.supported_on_gpu(lhs, rhs):
            raise NotImplementedError(
                "cuDNN block-scaled matmul takes NVFP4 x NVFP4, got "
                f"{lhs.fmt.name} x {rhs.fmt.name}"
            )
    tile = tiling.get("block_m") or scaled.default_tile(lhs.shape[0], rhs.shape[0])
    return scaled.scaled_matmul_grouped(lhs, rhs, group_sizes, tile=tile, out_dtype=out_dtype)


def _run_pallas(lhs, rhs, group_sizes, *, tiling, interpret, out_dtype):
    config = block_config(lhs, rhs, **tiling)
    return fp4_moe_matmul_pallas(
        lhs, rhs, group_sizes, config=config, interpret=interpret, out_dtype=out_dtype
    )


def _run_xla(lhs, rhs, group_sizes, *, tiling, interpret, out_dtype):
    del tiling, interpret
    return fp4_moe_matmul_reference(lhs, rhs, group_sizes, out_dtype=out_dtype)


_RUNNERS: dict[MoEImplementation, Callable[..., jax.Array]] = {
    MoEImplementation.SCALED_MATMUL: _run_scaled_matmul,
    MoEImplementation.PALLAS: _run_pallas,
    MoEImplementation.XLA: _run_xla,
}


def implementation_order(
    implementation: common.ImplementationLike | MoEImplementation,
) -> tuple[MoEImplementation, ...]:
    """The implementations `fp4_moe_matmul` tries, in order (see the module docstring)."""
    gpu_order = (MoEImplementation.PALLAS, MoEImplementation.XLA)
    if implementation is None and _compute_capability() >= 10:
        gpu_order = (MoEImplementation.SCALED_MATMUL, *gpu_order)
    return common.implementation_order(implementation, MoEImplementation, gpu_order)


def fp4_moe_matmul_with_implementation(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    implementation: common.ImplementationLike | MoEImplementation = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = _DEFAULTS.num_warps,
    num_stages: int = _DEFAULTS.num_stages,
    grid: str = _DEFAULTS.grid,
    interpret: bool | None = None,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> tuple[jax.Array, MoEImplementation]:
    """`fp4_moe_matmul` (same arguments) that also returns the implementation that ran."""
    check_operands(lhs, rhs, group_sizes)
    order = implementation_order(implementation)
    interpret = common.interpret_mode(interpret)
    tiling = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=grid,
    )

    def runner(name):
        return lambda: _RUNNERS[name](
            lhs, rhs, group_sizes, tiling=tiling, interpret=interpret, out_dtype=out_dtype
        )

    return common.run_first(order, {name: runner(name) for name in order})


def fp4_moe_matmul(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    implementation: common.ImplementationLike | MoEImplementation = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = _DEFAULTS.num_warps,
    num_stages: int = _DEFAULTS.num_stages,
    grid: str = _DEFAULTS.grid,
    interpret: bool | None = None,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """Grouped matmul `lhs [M, K] x rhs [G, N, K] -> [M, N]`, the `jax.lax.ragged_dot` contract.

    Args:
      lhs: bfloat16 `[M, K]`, or a `QTensor` `[M, K]` (MXFP4, NVFP4 or MXFP8; blocks along K).
      rhs: `PackedFP4Weights` `[G, N, K]` (see `pack_weights`).
      group_sizes: int32 `[G]`; rows are grouped contiguously, `sum(group_sizes) <= M`, rows past
        the sum give 0.
      implementation: None | "scaled_matmul" | "pallas" | "xla", or a sequence of them (see the
        module docstring).
      block_m, block_n, block_k: Pallas tiles (powers of two >= 16). None: 64, shrunk to fit M,
        to divide N, and to divide K while staying a multiple of the formats' block sizes.
      num_warps, num_stages: Triton launch parameters.
      grid: Pallas program order, "row_tiles" or "groups" (see `kernel.GRID_ORDERS`).
      interpret: Pallas interpret mode; None: on unless running on a GPU.
      out_dtype: output dtype; every implementation accumulates in float32.

    Not differentiable (no custom_vjp): the rollout path only runs it forward.
    """
    out, _ = fp4_moe_matmul_with_implementation(
        lhs,
        rhs,
        group_sizes,
        implementation=implementation,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=grid,
        interpret=interpret,
        out_dtype=out_dtype,
    )
    return out
