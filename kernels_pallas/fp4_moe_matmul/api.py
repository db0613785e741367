"""`fp4_moe_matmul`: the op's one public interface; tries implementations in order, moving on
at NotImplementedError, the XLA reference last.

Implementations, in the order the default (`implementation=None`) tries them on a GPU:
  * "scaled_matmul" (GPUs of compute capability >= 10, NVFP4 x NVFP4; and the CPU, where tests
    run it): `jax.nn.scaled_matmul` over per-group row tiles (`scaled.py`); NOT run on a
    Blackwell GPU here (none available), so its cuDNN lowering and speed are unverified.
  * "pallas" (`kernels_pallas.common.pallas_target`): `kernel.fp4_moe_matmul_pallas` through
    Triton (an NVIDIA GPU, or interpret=True), `mosaic.fp4_moe_matmul_mosaic` through Mosaic (a
    TPU, or interpret=`pltpu.InterpretParams()`; block_m, block_n, block_k as given, the Triton
    launch options num_warps, num_stages and grid ignored).
    With `predecode=True` (and by default with many rows per expert while `PREDECODE_BY_DEFAULT`
    is set: `predecode_by_default`) the weights are decoded once, before the call, and the bf16
    grouped matmul runs over them (`predecoded.py`: the Triton grid, or megablox on a TPU).
  * "xla": `reference.fp4_moe_matmul_reference`.
On a TPU the default is ("pallas", "xla"); where Pallas does not compile, the reference alone
(`kernels_pallas.common.implementation_order`). A named implementation runs alone and its errors
propagate; a sequence of names is tried in order.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import common
from kernels_pallas.fp4_moe_matmul import scaled
from kernels_pallas.fp4_moe_matmul.kernel import (
    BlockConfig,
    check_tiling,
    default_block_config,
    fp4_moe_matmul_pallas,
    lhs_format,
)
from kernels_pallas.fp4_moe_matmul.predecoded import (
    fp4_moe_matmul_predecoded,
    fp4_moe_matmul_predecoded_mosaic,
)
from kernels_pallas.fp4_moe_matmul.reference import (
    Lhs,
    PackedFP4Weights,
    check_operands,
    fp4_moe_matmul_reference,
)
from kernels_pallas.grouped_matmul import api as grouped_api
from trace_jax import fp4


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


def native_block_scaled() -> bool:
    """Whether the default GPU multiplies block-scaled FP4 in hardware (compute capability >= 10,
    Blackwell), where "scaled_matmul" leads the default order (`implementation_order`)."""
    return _compute_capability() >= 10


# Rows per expert from which the Triton path decodes the weights before its call (`predecoded.py`):
# the decode pass costs about what the in-kernel decode loses on 256 rows per expert at the
# H200's rates (bf16 grouped matmul 404 TFLOP/s, FP4 kernel 195, copy 3.3 TB/s); at 512 the
# expected gain holds even if that pass runs at half the copy bandwidth.
PREDECODE_MIN_ROWS_PER_GROUP = 512
# On: timed on an H200 at 65536 rows (`kernels_moe_matmul_default_tiles.md`) the predecoded calls
# take 0.653 ms with bf16 activations and 0.823 with NVFP4, against the in-kernel decode's 1.047
# and 1.061, their Pallas decode pass 0.175 ms (1.11x the copy limit; XLA's fusion took 0.534,
# with which the path gained nothing). At decode (512 rows) they take 0.29 ms against 0.10-0.12:
# the rows rule above keeps those calls in the kernel.
PREDECODE_BY_DEFAULT = True


def predecode_pays(m: int, g: int) -> bool:
    """Whether `[M, K] x [G, N, K]` has the rows per group from which decoding the weights before
    the call pays: `PREDECODE_MIN_ROWS_PER_GROUP` on average and more (prefill chunks, not
    decode steps)."""
    return m >= PREDECODE_MIN_ROWS_PER_GROUP * g


def predecode_by_default(m: int, g: int) -> bool:
    """Whether `[M, K] x [G, N, K]` decodes its weights before the call when `predecode` is None:
    where `PREDECODE_BY_DEFAULT` and `predecode_pays`."""
    return PREDECODE_BY_DEFAULT and predecode_pays(m, g)


def block_config(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    grid: str | None = None,
    weights_left: bool | None = None,
    split_by_scale_block: bool | None = None,
) -> BlockConfig:
    """The Pallas tiling for these operands: given values as they are (ValueError if they do not
    tile N and K or miss the formats' scale blocks), the rest from
    `kernel.default_block_config(M, G, K, N, lhs_fmt=...)` (with the "row_tiles" grid, block_m
    defaults to M up to 64 instead)."""
    m = lhs.shape[0]
    g, n, k = rhs.shape
    given = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=grid or BlockConfig.grid,
        weights_left=BlockConfig.weights_left if weights_left is None else weights_left,
        split_by_scale_block=(
            BlockConfig.split_by_scale_block
            if split_by_scale_block is None
            else split_by_scale_block
        ),
    )
    if given["grid"] == "row_tiles" and block_m is None:
        given["block_m"] = min(64, max(16, pl.next_power_of_2(m)))
    if any(value is None for value in given.values()):
        defaults = default_block_config(m, g, k, n, lhs_fmt=lhs_format(lhs))
        defaults = dataclasses.asdict(defaults)
        given = {f: defaults[f] if value is None else value for f, value in given.items()}
    config = BlockConfig(**given)
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


# The tiling keywords that describe the in-kernel decode only (`kernel.BlockConfig`).
IN_KERNEL_DECODE_SETTINGS = ("grid", "weights_left", "split_by_scale_block")


def _run_predecoded(lhs, rhs, group_sizes, *, tiling, interpret, out_dtype):
    """`predecoded.py` with the bf16 grouped matmul's tiles for these shapes (`grid` and
    `weights_left` describe the in-kernel decode: ValueError if given)."""
    fp4_only = [f for f in IN_KERNEL_DECODE_SETTINGS if tiling[f] is not None]
    if fp4_only:
        raise ValueError(f"{', '.join(fp4_only)} apply to the in-kernel decode, not predecode=True")
    m, k = lhs.shape
    g, n, _ = rhs.shape
    tiles = {f: tiling[f] for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages")}
    config = grouped_api.block_config(m, g, k, n, **tiles)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    return fp4_moe_matmul_predecoded(
        lhs, rhs, group_sizes, config=config, interpret=interpret, out_dtype=out_dtype
    )


def _run_pallas(lhs, rhs, group_sizes, *, tiling, interpret, out_dtype):
    target = common.pallas_target(interpret)
    tiling = dict(tiling)
    predecode = tiling.pop("predecode")
    if target.lowering is common.Lowering.MOSAIC:
        if predecode:
            m, k = lhs.shape
            tiles = grouped_api.megablox_tiling(
                m, k, rhs.shape[1], jnp.bfloat16,
                **{f: tiling[f] for f in ("block_m", "block_n", "block_k")},
            )  # fmt: skip
            matmul = functools.partial(fp4_moe_matmul_predecoded_mosaic, tiling=tiles)
        else:
            from kernels_pallas.fp4_moe_matmul.mosaic import fp4_moe_matmul_mosaic

            tiles = {
                f: tiling[f] for f in ("block_m", "block_n", "block_k") if tiling[f] is not None
            }
            matmul = functools.partial(fp4_moe_matmul_mosaic, **tiles)
    elif predecode or (predecode is None and predecode_by_default(lhs.shape[0], rhs.shape[0])):
        matmul = functools.partial(_run_predecoded, tiling=tiling)
    else:
        matmul = functools.partial(fp4_moe_matmul_pallas, config=block_config(lhs, rhs, **tiling))
    # GSPMD cannot partition a Pallas call (Mosaic or Triton); the groups span all rows, so on a
    # mesh each device runs the whole op.
    matmul = functools.partial(matmul, interpret=target.interpret, out_dtype=out_dtype)
    return common.per_device(matmul, lhs, rhs, group_sizes)


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
    native_order = (MoEImplementation.PALLAS, MoEImplementation.XLA)
    if implementation is None and native_block_scaled():
        native_order = (MoEImplementation.SCALED_MATMUL, *native_order)
    return common.implementation_order(implementation, MoEImplementation, native_order)


def fp4_moe_matmul_with_implementation(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    implementation: common.ImplementationLike | MoEImplementation = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    grid: str | None = None,
    weights_left: bool | None = None,
    split_by_scale_block: bool | None = None,
    predecode: bool | None = None,
    interpret: common.Interpret = None,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> tuple[jax.Array, MoEImplementation]:
    """`fp4_moe_matmul` (same arguments) that also returns the implementation that ran."""
    check_operands(lhs, rhs, group_sizes)
    order = implementation_order(implementation)
    tiling = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=grid,
        weights_left=weights_left,
        split_by_scale_block=split_by_scale_block,
        predecode=predecode,
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
    num_warps: int | None = None,
    num_stages: int | None = None,
    grid: str | None = None,
    weights_left: bool | None = None,
    split_by_scale_block: bool | None = None,
    predecode: bool | None = None,
    interpret: common.Interpret = None,
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
      block_m, block_n, block_k: Pallas tiles (powers of two, >= 16; block_k >= 32 and a
        multiple of the formats' block sizes); num_warps, num_stages: Triton launch parameters.
        None: `kernel.default_block_config` for these shapes (`block_config`); the Mosaic
        kernel's own defaults on a TPU.
      grid: Pallas program order, "row_tiles" or "groups" (default; see `kernel.GRID_ORDERS`).
      weights_left: the decoded weights as the tile dots' left operand (`kernel.BlockConfig`,
        the Triton kernel; None: off).
      split_by_scale_block: the packed weights read split by scale block, the block scales
        broadcast rather than expanded (`kernel.BlockConfig`, the Triton kernel; None: off).
      predecode: decode the weights in one pass before the call and run the bf16 grouped
        matmul over them (`predecoded.py`: Triton, the bf16 kernel's grid with the FP4 epilogue
        fused, block_* and the launch parameters then that kernel's, `grouped_matmul.
        block_config`; Mosaic, megablox `gmm` and the epilogue in XLA, block_* its tiles);
        None: `predecode_by_default` (prefill-sized calls, once enabled).
      interpret: None (native, or the `common.interpreting` context's choice), True (the Triton
        kernel interpreted) or `pltpu.InterpretParams` (the Mosaic kernel interpreted); see
        `common.pallas_target`.
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
        weights_left=weights_left,
        split_by_scale_block=split_by_scale_block,
        predecode=predecode,
        interpret=interpret,
        out_dtype=out_dtype,
    )
    return out
