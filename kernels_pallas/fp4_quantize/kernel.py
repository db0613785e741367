"""Pallas kernel: one pass over `x [R, N]` -> packed FP4 codes, block scales, global scale and the
compact guidance bits, with round-to-nearest or rollout-guided rounding.

Each program owns `block_r` whole rows (the NVFP4 global scale is per row, so a row never spans
programs) and runs `trace_jax.fp4.quantize_core`, the quantizer itself, on them: kernel and
quantizer cannot drift apart. Bytes moved per element: read 2 (bf16) or 4 (f32); write 1/2 (codes)
+ 1/8 (compact bits) + 1/block (scale) (+ 4/N global): the pass is bandwidth-bound.

With `block_n < N` each program owns a `[block_r, block_n]` tile instead (a 2-D grid over rows and
column tiles): more, smaller programs, at the price of the NVFP4 global scale being computed
beforehand (one more read of the row, by XLA) and passed in. With `loop_n` a program keeps whole
rows but walks them in column chunks, NVFP4's global scale from a first pass over the chunks (the
second read of a row band of a few KB hits L2): the column tiles' small working set without the
separate XLA pass.

Triton lowering needs power-of-two tile shapes, so N must be a power of two (the API falls back to
the XLA reference otherwise). Hopper-specific: the reciprocal estimate `common.rcp_approx` (inline
PTX, valid on any NVIDIA GPU; corrected to the IEEE reciprocal, so codes do not depend on it) and
the launch defaults in `api.py` (column tiles, row loop, warps) from the H200. A Blackwell run
should check first that codes, scales and bits equal the CPU's bit for bit, then re-time the
launches. The TPU lowering (whole rows) is `mosaic.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import common
from trace_jax.fp4 import BlockFormat, GuidanceMode, numerics
from trace_jax.fp4.quantize import Rounding, quantize_core
from trace_jax.fp4.scales import global_scale_from_amax


def _pack(values: jax.Array, per_byte: int) -> jax.Array:
    """Packs `per_byte` small fields per byte along the last axis (field j at bit j * width)."""
    r, n = values.shape
    width = 8 // per_byte
    v = values.astype(jnp.int32).reshape(r, n // per_byte, per_byte)
    # Kernels cannot capture array constants: build the field shifts from an iota.
    shifts = jax.lax.broadcasted_iota(jnp.int32, v.shape, 2) * width
    return jnp.sum(v << shifts, axis=-1).astype(jnp.uint8)


def _pack_by_split(values: jax.Array, per_byte: int) -> jax.Array:
    """`_pack` by halving: adjacent pairs joined as lo | hi << shift, the shift doubling each
    round (`jnp.unstack` of a trailing 2: Triton's split, no reduction), until `per_byte`
    fields share a byte."""
    v, shift = values.astype(jnp.int32), 8 // per_byte
    for _ in range(per_byte.bit_length() - 1):  # log2(per_byte) rounds
        r, n = v.shape
        lo, hi = jnp.unstack(v.reshape(r, n // 2, 2), axis=-1)
        v, shift = lo | (hi << shift), 2 * shift
    return v.astype(jnp.uint8)


PACKINGS = {"sum": _pack, "split": _pack_by_split}
# Split packing ran 2-5% faster than the summed fields on the H200 (no reduction over a trailing
# axis, which Triton may lower with layout conversions).
DEFAULT_PACK = "split"


def _unpack(packed: jax.Array, per_byte: int) -> jax.Array:
    r, m = packed.shape
    width = 8 // per_byte
    shape = (r, m, per_byte)
    shifts = jax.lax.broadcasted_iota(jnp.int32, shape, 2) * width
    v = (jnp.broadcast_to(packed.astype(jnp.int32)[..., None], shape) >> shifts) & (
        (1 << width) - 1
    )
    return v.reshape(r, m * per_byte)


def _kernel(
    *refs,
    fmt: BlockFormat,
    guide_mode: GuidanceMode | None,
    s_g_given: bool,
    loop_n: int | None,
    pack: str = DEFAULT_PACK,
    inline_asm: bool = False,
):
    pack_fields = PACKINGS[pack]
    # The reciprocal's hardware estimate: one PTX instruction on the GPU (same bits either way).
    estimate = common.rcp_approx if inline_asm else None
    refs = list(refs)
    x_ref = refs.pop(0)
    sg_ref = refs.pop(0) if s_g_given else None
    if guide_mode is not None:
        g_payload_ref, g_bits_ref, g_gs_ref = refs[:3]
        refs = refs[3:]
    codes_ref, bits_ref, cbits_ref = refs[:3]
    gs_ref = refs[3] if len(refs) > 3 else None
    n, bs = x_ref.shape[1], fmt.block_size
    step = loop_n or n
    # Column chunks of the program's tile, processed one after the other (one chunk: the whole
    # tile at once); a second read of a chunk comes from L2, not HBM.
    chunks = [(a, a + step) for a in range(0, n, step)]
    whole = len(chunks) == 1  # the tile in one piece: plain whole-ref loads and stores, x read once
    x_tile = x_ref[...].astype(jnp.float32) if whole else None

    def cols(ref, a, b, per):  # columns [a, b) of x as columns of `ref` (`per` x-columns each)
        return ref[...] if whole else ref[:, a // per : b // per]

    def store(ref, a, b, per, value):
        if whole:
            ref[...] = value
        else:
            ref[:, a // per : b // per] = value

    def x_chunk(a, b):
        return x_tile if whole else cols(x_ref, a, b, 1).astype(jnp.float32)

    s_g = None
    if fmt.has_global_scale:
        if s_g_given:
            s_g = sg_ref[...]
        else:  # the row's max |x| over all chunks first
            amax = None
            for a, b in chunks:
                m = numerics.abs_max(x_chunk(a, b), 1, keepdims=True)
                amax = m if amax is None else jnp.maximum(amax, m)
            s_g = global_scale_from_amax(amax, fmt)
    rounding = Rounding.RTN if guide_mode is None else Rounding.GUIDED
    for a, b in chunks:
        kwargs = {}
        if guide_mode is not None:
            if guide_mode is GuidanceMode.FULL:
                kwargs["guide_codes"] = _unpack(cols(g_payload_ref, a, b, 2), 2)
            else:
                kwargs["guide_bits"] = _unpack(cols(g_payload_ref, a, b, 8), 8)
            kwargs["guide_scale_bits"] = cols(g_bits_ref, a, b, bs)
            kwargs["guide_global"] = g_gs_ref[...] if fmt.has_global_scale else None
        codes, bits, s_g_out = quantize_core(
            x_chunk(a, b), fmt, s_g=s_g, rounding=rounding, reciprocal_estimate=estimate, **kwargs
        )
        store(codes_ref, a, b, 2, pack_fields(codes, 2))
        store(bits_ref, a, b, bs, bits)
        store(cbits_ref, a, b, 8, pack_fields(codes & 1, 8))
    if gs_ref is not None:
        gs_ref[...] = s_g_out if s_g_out is not None else jnp.ones(gs_ref.shape, jnp.float32)


def quantize_capture_pallas(
    x: jax.Array,
    fmt: BlockFormat,
    *,
    guide: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    guide_mode: GuidanceMode | None = None,
    block_r: int,
    interpret: bool,
    num_warps: int = 4,
    block_n: int | None = None,
    s_g: jax.Array | None = None,
    loop_n: int | None = None,
    body: Callable | None = None,
    pack: str = DEFAULT_PACK,
):
    """Runs the kernel on `x [R, N]` (R a multiple of `block_r`).

    guide: (payload uint8 [R, N/2 or N/8], scale bits uint8 [R, NB], global float32 [R, 1]).
    block_n: columns per program (a power of two dividing N, a multiple of the block and of 8;
      None: whole rows). Below N, NVFP4 needs the rows' own global scales `s_g` float32 [R, 1].
    loop_n: with whole rows, process each row band in column chunks of this width, one after
      the other (NVFP4: a first pass over the chunks for the global scale); None: all at once.
    body: the kernel body (default `_kernel`; `experiments.quantize_ablation` passes cut-down
      bodies with the same refs and keyword arguments to time the kernel's parts; `inline_asm`
      is True when compiled for the GPU, where the reciprocal needs `common.rcp_approx`).
    pack: how codes and compact bits are packed into bytes: "split" (pairs joined by halving,
      the default) or "sum" (shifted fields summed over a trailing axis); the same bytes.
    Returns (packed codes [R, N/2], scale bits [R, NB], compact bits [R, N/8], global [R, 1]);
    with column tiles the global scale is not an output (it is `s_g`, or the guidance's).
    """
    if pack not in PACKINGS:
        raise ValueError(f"pack must be one of {sorted(PACKINGS)}, got {pack!r}")
    r, n = x.shape
    block_n = block_n or n
    tiled = block_n < n
    if tiled and fmt.has_global_scale and s_g is None:
        raise ValueError("column tiles of an NVFP4 row need the row's global scale `s_g`")
    bs = fmt.block_size
    grid = (r // block_r, n // block_n)

    def tile(width_per_block_n):  # a [block_r, block_n * ratio] tile of an [R, N * ratio] array
        return pl.BlockSpec((block_r, width_per_block_n), lambda i, j: (i, j))

    def row_vec():
        return pl.BlockSpec((block_r, 1), lambda i, j: (i, 0))

    in_specs = [tile(block_n)]
    args = [x]
    given = tiled and fmt.has_global_scale
    if given:
        in_specs.append(row_vec())
        args.append(s_g)
    if guide is not None:
        payload, g_bits, g_gs = guide
        in_specs += [tile(block_n * payload.shape[1] // n), tile(block_n // bs), row_vec()]
        args += [payload, g_bits, g_gs]
    out_shape = [
        jax.ShapeDtypeStruct((r, n // 2), jnp.uint8),
        jax.ShapeDtypeStruct((r, n // bs), jnp.uint8),
        jax.ShapeDtypeStruct((r, n // 8), jnp.uint8),
    ]
    out_specs = [tile(block_n // 2), tile(block_n // bs), tile(block_n // 8)]
    if not tiled:
        out_shape.append(jax.ShapeDtypeStruct((r, 1), jnp.float32))
        out_specs.append(row_vec())
    return pl.pallas_call(
        functools.partial(
            body or functools.partial(_kernel, pack=pack),
            fmt=fmt,
            guide_mode=guide_mode,
            s_g_given=given,
            loop_n=loop_n,
            inline_asm=not interpret,
        ),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="fp4_quantize",
        compiler_params=None if interpret else common.triton_params(num_warps=num_warps),
    )(*args)
