"""`fp4_quantize`: fused quantize + guidance capture, the op's one public interface.

Implementations (`implementation=`, see `kernels_pallas.common`): "pallas" (the fused kernel; rows
of a power-of-two width only) and "xla" (`quantize_capture_reference`, any width). Both give the
same codes, scales and bits. The Pallas kernel is `kernel.quantize_capture_pallas` (Triton: an
NVIDIA GPU, or interpret=True) or `mosaic.quantize_capture_mosaic` (Mosaic: a TPU, or
interpret=`pltpu.InterpretParams()`; whole rows only, so the Triton launch options block_n and
loop_n are refused, num_warps and pack ignored).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas import common
from kernels_pallas.common import Implementation, ImplementationLike, Interpret, Lowering
from kernels_pallas.fp4_quantize.kernel import DEFAULT_PACK, quantize_capture_pallas
from kernels_pallas.fp4_quantize.reference import QuantizedCapture, quantize_capture_reference
from trace_jax import fp4
from trace_jax.fp4 import BlockFormat, Guidance, GuidanceMode
from trace_jax.fp4.scales import from_bits, global_scale, to_bits


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(x: jax.Array, fmt: BlockFormat, guidance: Guidance | None) -> None:
    if not fmt.is_fp4:
        raise ValueError(f"fp4_quantize packs FP4 codes; got {fmt.name}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"fp4_quantize expects a floating-point array, got {x.dtype}")
    fp4.qtensor.blocks_shape(x.shape, fmt)
    if guidance is not None:
        guidance.check_matches(x.shape, fmt)
        if guidance.mask is not None:
            raise ValueError("fp4_quantize: guidance masks are not supported; use fp4.quantize")


TILE_ELEMENTS = 2048
# Rows wider than this are cut into column tiles of this width and COLUMN_TILE_ROWS rows by
# default: on the H200 every 4096-element column tile (16 x 256, 8 x 512, 4 x 1024) ran 1.3x
# (MXFP4) to 3.5x (NVFP4) faster than one whole 4096-wide row per program: more, smaller
# programs (`experiments/results/kernels_quantize.md`).
COLUMN_TILE = 1024
COLUMN_TILE_ROWS = 4
# NVFP4 rows wider than this are walked by ROW_LOOP_ROWS-row programs in chunks of this width, the
# global scale from a first pass over the chunks (no separate XLA pass over the rows): 0.356 ms
# against 0.456 ms for column tiles plus XLA's global scale at 65536 x 4096 bf16 on the H200,
# one read of the rows fewer.
ROW_LOOP_CHUNK = 2048
ROW_LOOP_ROWS = 2
# Rows per program of the Mosaic kernel by default (fewer rows are one program of all of them): a
# multiple of the 8-bit sublane tile (32), so the packed uint8 outputs tile without padding. Not
# tuned on a TPU.
MOSAIC_BLOCK_R = 32


def default_launch(fmt: BlockFormat, n: int) -> tuple[int | None, int | None, int | None]:
    """(block_r, block_n, loop_n) of `fp4_quantize` for rows of width `n` when none is given
    (None: the kernel's whole-row default for that argument)."""
    if fmt.has_global_scale and n > ROW_LOOP_CHUNK:
        return ROW_LOOP_ROWS, None, ROW_LOOP_CHUNK
    if n > COLUMN_TILE:
        return COLUMN_TILE_ROWS, COLUMN_TILE, None
    return None, None, None


def fp4_quantize(
    x: jax.Array,
    fmt: str | BlockFormat,
    *,
    guidance: Guidance | None = None,
    implementation: ImplementationLike = None,
    block_r: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    loop_n: int | None = None,
    pack: str = DEFAULT_PACK,
    interpret: Interpret = None,
) -> QuantizedCapture:
    """Quantizes `x [..., N]` (RTN, or guided by `guidance`) and captures compact guidance.

    Codes, scales and bits are identical to `trace_jax.fp4` (NVFP4: one global scale per row).
    `implementation`: None, "pallas", "xla" or a sequence of them (`kernels_pallas.common`); the
    Pallas kernel needs N a power of two (NotImplementedError otherwise, so None and
    ("pallas", "xla") fall back to the reference). `block_r` rows per
    program and `block_n` columns per program (a power of two dividing N, a multiple of the block
    and of 8; below N the NVFP4 global scale is computed by XLA first). Default
    (`default_launch`, the fastest measured): NVFP4 rows wider than ROW_LOOP_CHUNK walked in
    chunks of it, ROW_LOOP_ROWS rows per program; other rows wider than COLUMN_TILE in
    COLUMN_TILE_ROWS x COLUMN_TILE tiles; narrower rows whole, about TILE_ELEMENTS elements (at
    most 16 rows) per program. `loop_n` (whole rows
    only): each program walks its rows in column chunks of this width, the NVFP4 global scale
    from a first pass over them (no separate XLA read of the rows). `num_warps` per program on
    the GPU. `pack`: how the kernel packs codes and compact bits into bytes ("split" or "sum",
    the same bytes; `quantize_capture_pallas`). `interpret`: None (native, or the
    `common.interpreting` context's choice), True (the Triton kernel interpreted) or
    `pltpu.InterpretParams` (the Mosaic kernel interpreted); see `common.pallas_target`.
    """
    out, _ = fp4_quantize_with_implementation(
        x,
        fmt,
        guidance=guidance,
        implementation=implementation,
        block_r=block_r,
        block_n=block_n,
        num_warps=num_warps,
        loop_n=loop_n,
        pack=pack,
        interpret=interpret,
    )
    return out


def fp4_quantize_with_implementation(
    x: jax.Array,
    fmt: str | BlockFormat,
    *,
    guidance: Guidance | None = None,
    implementation: ImplementationLike = None,
    block_r: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    loop_n: int | None = None,
    pack: str = DEFAULT_PACK,
    interpret: Interpret = None,
) -> tuple[QuantizedCapture, Implementation]:
    """`fp4_quantize` (same arguments) that also returns the implementation that ran."""
    fmt = fp4.get_format(fmt)
    x = jnp.asarray(x)
    _check(x, fmt, guidance)
    order = common.implementation_order(implementation)
    launch = dict(
        block_r=block_r,
        block_n=block_n,
        num_warps=num_warps,
        loop_n=loop_n,
        pack=pack,
        interpret=interpret,
    )

    def run_pallas():
        def quantize(x, guidance):
            return _quantize_pallas(x, fmt, guidance, **launch)

        g = guidance
        if g is not None and g.global_scale is not None and x.ndim > 1:
            # A broadcast (per-tensor) global scale as one per row, so that every operand has
            # the rows as its leading axis (`per_device`'s split); the kernel broadcasts it so.
            g = dataclasses.replace(
                g, global_scale=jnp.broadcast_to(g.global_scale, (*x.shape[:-1], 1))
            )
        # Rows are independent: on a mesh each device quantizes its own (Triton or Mosaic alike:
        # GSPMD cannot partition either custom call and would gather the rows to every device).
        return common.per_device(quantize, x, g, split_leading=x.ndim > 1)

    runners = {
        Implementation.PALLAS: run_pallas,
        Implementation.XLA: lambda: quantize_capture_reference(x, fmt, guidance=guidance),
    }
    return common.run_first(order, runners)


def _quantize_pallas(
    x: jax.Array,
    fmt: BlockFormat,
    guidance: Guidance | None,
    *,
    block_r: int | None,
    block_n: int | None,
    num_warps: int,
    loop_n: int | None,
    pack: str,
    interpret: Interpret,
) -> QuantizedCapture:
    """The Pallas implementation of `fp4_quantize` (launch arguments as there)."""
    target = common.pallas_target(interpret)
    n = x.shape[-1]
    if not _is_pow2(n):
        raise NotImplementedError(
            f"the Pallas quantize kernel tiles rows of a power-of-two width; got N={n}"
        )
    mosaic = target.lowering is Lowering.MOSAIC
    if mosaic:
        if block_n is not None or loop_n is not None:
            raise ValueError(
                f"the Mosaic quantize kernel takes whole rows; got block_n={block_n}, "
                f"loop_n={loop_n} (Triton launch options)"
            )
    elif loop_n is not None:
        if block_n is not None and block_n < n:
            raise ValueError("loop_n walks whole rows: give it without block_n")
        if not (_is_pow2(loop_n) and n % loop_n == 0 and loop_n % max(fmt.block_size, 8) == 0):
            raise ValueError(
                f"loop_n={loop_n} must be a power of two dividing N={n} and a multiple of "
                f"{max(fmt.block_size, 8)}"
            )
    elif block_n is None and block_r is None:
        block_r, block_n, loop_n = default_launch(fmt, n)
    if block_n is not None and block_n < n:
        if not (_is_pow2(block_n) and n % block_n == 0 and block_n % max(fmt.block_size, 8) == 0):
            raise ValueError(
                f"block_n={block_n} must be a power of two dividing N={n} and a multiple of "
                f"{max(fmt.block_size, 8)}"
            )
    else:
        block_n = None
    lead = x.shape[:-1]
    rows = 1
    for d in lead:
        rows *= d
    if mosaic and block_r is None:
        block_r = min(MOSAIC_BLOCK_R, max(8, -(-rows // 8) * 8))
    elif block_r is None:
        # A program holds its whole tile in registers; 65536-element tiles (16 rows of 4096) took
        # minutes to compile on the H200 and never finished a run, so tiles stay small.
        block_r = max(1, min(16, TILE_ELEMENTS // n))
    padded = -(-rows // block_r) * block_r

    def flat(a, width):
        a = a.reshape(rows, width)
        return jnp.pad(a, ((0, padded - rows), (0, 0)))

    guide, mode = None, None
    if guidance is not None:
        mode = guidance.mode
        gs = guidance.global_scale
        if gs is None:
            gs = jnp.ones((*lead, 1), jnp.float32)
        gs = jnp.broadcast_to(gs, (*lead, 1))
        guide = (
            flat(guidance.payload, guidance.payload.shape[-1]),
            flat(to_bits(guidance.scales), n // fmt.block_size),
            flat(gs, 1),
        )
    s_g = None
    if block_n is not None and fmt.has_global_scale:  # the kernel sees only part of a row
        s_g = global_scale(flat(x, n).astype(jnp.float32), fmt, (1,))
    if mosaic:  # whole rows only (checked above)
        from kernels_pallas.fp4_quantize.mosaic import quantize_capture_mosaic as capture

        launch = {}
    else:
        capture = quantize_capture_pallas
        launch = dict(num_warps=num_warps, block_n=block_n, s_g=s_g, loop_n=loop_n, pack=pack)
    packed, bits, cbits, *gsc = capture(
        flat(x, n),
        fmt,
        guide=guide,
        guide_mode=mode,
        block_r=block_r,
        interpret=target.interpret,
        **launch,
    )
    # With column tiles the global scale is the one the kernel was given (guided: the rollout's,
    # except on rows whose own is NaN, as in `quantize_core`).
    if gsc:
        gsc = gsc[0]
    elif guide is None or s_g is None:
        gsc = s_g
    else:
        gsc = jnp.where(jnp.isnan(s_g), s_g, guide[2])

    def unflat(a):
        return a[:rows].reshape(*lead, a.shape[-1])

    return QuantizedCapture(
        packed_codes=unflat(packed),
        scales=from_bits(unflat(bits), fmt),
        global_scale=unflat(gsc) if fmt.has_global_scale else None,
        compact_bits=unflat(cbits),
        fmt=fmt,
    )


__all__ = [
    "GuidanceMode",
    "Implementation",
    "QuantizedCapture",
    "fp4_quantize",
    "fp4_quantize_with_implementation",
]
