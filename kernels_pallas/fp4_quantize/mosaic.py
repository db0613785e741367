"""Mosaic (TPU) kernel of fused quantize + compact capture: the contract of
`kernel.quantize_capture_pallas` for whole rows, the same bytes as it and as `trace_jax.fp4`.

Each program owns `block_r` whole rows `[block_r, N]` (the NVFP4 global scale is per row), FP4
blocks along the lanes. What differs from the Triton kernel, and why:

- Blocks. The Triton body runs `quantize_core`, which views a tile as `[rows, NB, block]`; under
  Mosaic that reshape splits the lane axis into 16- or 32-lane minor dims, a relayout Mosaic's
  vector layout pass offers only for whole 128-lane groups. This body keeps `[rows, N]` and
  gives every lane its block's values instead: the block max by a butterfly of lane rotations
  (`pltpu.roll`, log2(block) steps: `numerics.abs_max`'s integer max, which needs the blocked
  view), then the scale bits, the scale's reciprocal and the rollout's scale bits per lane.
  Those and the rounding are the functions `quantize_core` itself calls, which take any shape:
  `scales.block_scale_bits_from_amax`, `quantize.rollout_scales`, `scales.inverse_scale` and
  `quantize.round_to_codes`, in int32 (8-bit vector arithmetic is not native on every TPU);
  tests hold the bytes to the quantizer's.
- Packing. Packed bytes (2 codes or 8 bits from neighbouring lanes, one scale per block) are lane
  compactions, and the rollout's bytes spread over their lanes are lane expansions: Mosaic has no
  lane gather, and strided loads and stores stride only along sublanes. Both run on the otherwise
  idle MXU as matmuls with constant matrices of zeros and powers of two: every operand is an
  integer below 256 (exact in bfloat16) and every sum is below 256 (exact in the float32
  accumulator). Each pass costs 128 multiply-adds per element (128-lane output pieces).
- Reciprocal. `numerics.reciprocal_rn` needs an estimate of `1 / m` within two ulp; this kernel
  passes `reciprocal_estimate`: the hardware's approximate reciprocal (`pltpu.reciprocal(approx=
  True)`) refined by two Newton steps, within two ulp for any approximation within 2**-8
  (tested with perturbed approximations; TPU interpret mode's is bfloat16's, about 2**-8).
- Tiles. Outputs stay uint8 (no 4x wider writes); uint8 tiles need 32-row blocks, so `block_r`
  is a multiple of 32 or all of R. Rows are processed in column chunks of 128 blocks, so every
  output piece is a whole number of 128-lane groups (or the whole row).

On the CPU `jit(...).lower(lowering_platforms=("tpu",))` checks the Pallas-to-Mosaic lowering;
Mosaic's layout passes run only in the TPU compiler. A first TPU run should check that the kernel
compiles (the int32 lane rotations over multi-vreg rows, the row's int32 max reduction, the
int32 <-> bf16 casts of the packing), the bytes against `trace_jax.fp4` on random and NaN/Inf
rows (the hardware approximation differs from interpret mode's), the VMEM use of wide rows
(temporaries of `[block_r, 128 * block]` float32), and the time against HBM bandwidth: the
per-lane reciprocal of NVFP4's scale (about 40 VPU operations per element) may make it
VPU-bound, where a per-block reciprocal spread back by the MXU would be cheaper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from trace_jax.fp4 import BlockFormat, GuidanceMode, numerics, scales
from trace_jax.fp4.quantize import Rounding, rollout_scales, round_to_codes

LANES = 128
# uint8 arrays tile VMEM in (32, 128) blocks.
UINT8_SUBLANES = 32
_NEWTON_STEPS = 2


def newton_reciprocal(m: jax.Array, r0: jax.Array, steps: int = _NEWTON_STEPS) -> jax.Array:
    """`r0 ~ 1 / m` refined by `steps` Newton steps `r + r * (1 - m * r)` (float32, any shape).

    Each step squares the relative error and adds at most 1.5 ulp of float32 rounding (the
    product `m * r`, close to 1, rounds by at most 2**-24; `1 - m * r` is then exact; the sum
    rounds by half an ulp), so two steps bring an approximation within 2**-8 to within two ulp
    of `1 / m`: what `numerics.reciprocal_rn` corrects to the correctly rounded reciprocal.
    """
    r = r0
    for _ in range(steps):
        r = r + r * (np.float32(1.0) - m * r)
    return r


def reciprocal_estimate(m: jax.Array) -> jax.Array:
    """The estimate of `1 / m` (float32 m in [1, 2)) the Mosaic kernel gives
    `numerics.reciprocal_rn`: the TPU's approximate reciprocal and two Newton steps. Inside a
    Pallas TPU kernel only (or TPU interpret mode, where the approximation is bfloat16's)."""
    return newton_reciprocal(m, pltpu.reciprocal(m, approx=True))


def _block_abs_max(x: jax.Array, block: int) -> jax.Array:
    """`numerics.abs_max` of each aligned group of `block` lanes, on every lane of the group:
    float32 `[r, w]` -> `[r, w]`. A butterfly of lane rotations stands in for abs_max's reduction
    over a `[r, w / block, block]` view, which Mosaic cannot form (module docstring); like
    abs_max it takes an int32 max over the bit patterns of |x|, so NaN wins on every backend.
    Step `s` takes the max with lane `i ^ s`, which a rotation by `s` one way or the other brings
    to lane `i`."""
    m = jax.lax.bitcast_convert_type(jnp.abs(x), jnp.int32)
    w = m.shape[1]
    lane = jax.lax.broadcasted_iota(jnp.int32, m.shape, 1)
    s = 1
    while s < block:
        partner = jnp.where((lane & s) != 0, pltpu.roll(m, s, 1), pltpu.roll(m, w - s, 1))
        m = jnp.maximum(m, partner)
        s *= 2
    return jax.lax.bitcast_convert_type(m, jnp.float32)


def _as_bf16(v: jax.Array) -> jax.Array:
    return v.astype(jnp.float32).astype(jnp.bfloat16)  # integers below 256: exact


def _lane_matmul(values: jax.Array, matrix: jax.Array) -> jax.Array:
    """Lane compaction or expansion on the MXU: int32 `values [r, w]` times `matrix [s, t]`, one
    s-lane piece at a time -> int32 `[r, w * t / s]` (exact: see the module docstring)."""
    span = matrix.shape[0]
    pieces = [
        jnp.dot(_as_bf16(values[:, i : i + span]), matrix, preferred_element_type=jnp.float32)
        for i in range(0, values.shape[1], span)
    ]
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
    return out.astype(jnp.int32)


def _gather_matrix(k: int, width: int, taps: int, chunk: int) -> jax.Array:
    """bf16 `[c * k, c]` (c = min(128, chunk / k)): output lane q sums input lanes `q * k + j`
    (j < taps) times `2**(width * j)`: packs `taps` fields of `width` bits, or picks lane
    `q * k` (taps 1)."""
    c = min(LANES, chunk // k)
    d = jax.lax.broadcasted_iota(jnp.int32, (c * k, c), 0) - k * jax.lax.broadcasted_iota(
        jnp.int32, (c * k, c), 1
    )
    weight = jnp.left_shift(1, width * jnp.clip(d, 0, taps - 1))
    return jnp.where((d >= 0) & (d < taps), weight, 0).astype(jnp.bfloat16)


def _spread_matrix(k: int, chunk: int) -> jax.Array:
    """bf16 `[c, c * k]` (c = min(128, chunk / k)): input lane q to output lanes `q * k + j`."""
    c = min(LANES, chunk // k)
    d = jax.lax.broadcasted_iota(jnp.int32, (c, c * k), 1) - k * jax.lax.broadcasted_iota(
        jnp.int32, (c, c * k), 0
    )
    return ((d >= 0) & (d < k)).astype(jnp.bfloat16)


def _kernel(*refs, fmt: BlockFormat, guide_mode: GuidanceMode | None, chunk: int):
    refs = list(refs)
    x_ref = refs.pop(0)
    if guide_mode is not None:
        payload_ref, g_bits_ref, g_global_ref = (refs.pop(0) for _ in range(3))
    pack_codes, pack_bits, pick_scales = (refs.pop(0)[...] for _ in range(3))
    if guide_mode is not None:
        spread_payload, spread_scales = (refs.pop(0)[...] for _ in range(2))
    codes_ref, bits_ref, cbits_ref, global_ref = refs
    n, bs = x_ref.shape[1], fmt.block_size
    per_byte = 2 if guide_mode is GuidanceMode.FULL else 8

    def spread(ref, a, b, per, matrix):  # the rollout's bytes of columns [a, b), on their lanes
        return _lane_matmul(ref[:, a // per : b // per].astype(jnp.int32), matrix)

    s_g = s_g_used = g_global = None
    if fmt.has_global_scale:
        row_amax = numerics.abs_max(x_ref[...], 1, keepdims=True)
        s_g = s_g_used = scales.global_scale_from_amax(row_amax, fmt)
        if guide_mode is not None:
            g_global = g_global_ref[...]
    rounding = Rounding.RTN if guide_mode is None else Rounding.GUIDED
    for a in range(0, n, chunk):
        b = a + chunk
        x = x_ref[:, a:b].astype(jnp.float32)
        amax = _block_abs_max(x, bs)
        bits = scales.block_scale_bits_from_amax(amax, fmt, s_g, estimate=reciprocal_estimate)
        guide = {}
        if guide_mode is not None:
            rollout_bits = spread(g_bits_ref, a, b, bs, spread_scales)
            bits, s_g_used = rollout_scales(bits, s_g, fmt, rollout_bits, g_global)
            byte = spread(payload_ref, a, b, per_byte, spread_payload)
            lane = jax.lax.broadcasted_iota(jnp.int32, byte.shape, 1)
            if guide_mode is GuidanceMode.FULL:
                guide["guide_codes"] = jnp.where((lane & 1) != 0, byte >> 4, byte & 0xF)
            else:
                guide["guide_bits"] = (byte >> (lane & 7)) & 1
        z = x * scales.inverse_scale(bits, s_g_used, fmt, estimate=reciprocal_estimate)
        codes = round_to_codes(z, fmt.elem, rounding=rounding, **guide)
        codes_ref[:, a // 2 : b // 2] = _lane_matmul(codes, pack_codes).astype(jnp.uint8)
        cbits_ref[:, a // 8 : b // 8] = _lane_matmul(codes & 1, pack_bits).astype(jnp.uint8)
        bits_ref[:, a // bs : b // bs] = _lane_matmul(bits, pick_scales).astype(jnp.uint8)
    if s_g_used is None:
        s_g_used = jnp.ones(global_ref.shape, jnp.float32)
    global_ref[...] = s_g_used


def _check(x, fmt: BlockFormat, guide, guide_mode, block_r: int) -> None:
    if not fmt.is_fp4:
        raise ValueError(f"quantize_capture_mosaic packs FP4 codes; got {fmt.name}")
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating [R, N] array; got {x.dtype} {x.shape}")
    r, n = x.shape
    if n < LANES or n & (n - 1):
        raise NotImplementedError(
            f"the Mosaic quantize kernel takes rows of a power-of-two width >= {LANES}; got N={n}"
        )
    if block_r <= 0 or r % block_r:
        raise ValueError(f"block_r={block_r} must be a positive divisor of R={r}")
    if block_r % UINT8_SUBLANES and block_r != r:
        raise ValueError(
            f"block_r={block_r} must be a multiple of {UINT8_SUBLANES} (uint8 tiles) or R={r}"
        )
    if (guide is None) != (guide_mode is None):
        raise ValueError("guide and guide_mode go together: give both or neither")
    if guide is None:
        return
    if len(guide) != 3:
        raise ValueError(f"guide is (payload, scale bits, global); got {len(guide)} arrays")
    per_byte = 2 if GuidanceMode(guide_mode) is GuidanceMode.FULL else 8
    names = ("payload", "scale bits", "global")
    want = [((r, n // per_byte), jnp.uint8), ((r, n // fmt.block_size), jnp.uint8)]
    want.append(((r, 1), jnp.float32))
    for name, got, (shape, dtype) in zip(names, guide, want, strict=True):
        if tuple(got.shape) != shape or got.dtype != dtype:
            raise ValueError(
                f"{guide_mode} guide {name} must be {jnp.dtype(dtype).name} {shape}; "
                f"got {got.dtype} {tuple(got.shape)}"
            )


def quantize_capture_mosaic(
    x: jax.Array,
    fmt: BlockFormat,
    *,
    guide: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    guide_mode: GuidanceMode | None = None,
    block_r: int,
    interpret: pltpu.InterpretParams | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantizes `x [R, N]` (RTN, or guided by `guide`) and captures compact guidance on a TPU.

    x: floating `[R, N]`, N a power of two >= 128 (NotImplementedError otherwise), R a multiple
      of `block_r`, itself a multiple of 32 or R (uint8 tiles).
    guide: the rollout's (payload uint8 `[R, N/2]` (full) or `[R, N/8]` (compact), scale bits
      uint8 `[R, NB]`, global float32 `[R, 1]`), with `guide_mode`; None: round to nearest.
    interpret: `pltpu.InterpretParams()` runs the kernel with TPU semantics on the CPU; None
      compiles it for a TPU.
    Returns (packed codes uint8 `[R, N/2]`, scale bits uint8 `[R, NB]`, compact bits uint8
    `[R, N/8]`, global scale float32 `[R, 1]` (ones without one)): the bytes of
    `quantize_capture_pallas` and of `trace_jax.fp4`.
    """
    _check(x, fmt, guide, guide_mode, block_r)
    r, n = x.shape
    bs = fmt.block_size
    guide_mode = None if guide_mode is None else GuidanceMode(guide_mode)
    chunk = min(n, LANES * bs)

    def rows(width):  # a [block_r, width] tile of an [R, width] array
        return pl.BlockSpec((block_r, width), lambda i: (i, 0))

    def resident(m):  # a constant matrix, fetched once
        return pl.BlockSpec(m.shape, lambda i: (0, 0), pipeline_mode=pl.Buffered(1))

    args, in_specs = [x], [rows(n)]
    if guide is not None:
        args += list(guide)
        in_specs += [rows(guide[0].shape[1]), rows(n // bs), rows(1)]
    matrices = [
        _gather_matrix(2, 4, 2, chunk),  # two 4-bit codes per byte
        _gather_matrix(8, 1, 8, chunk),  # eight mantissa bits per byte
        _gather_matrix(bs, 0, 1, chunk),  # a block's first lane
    ]
    if guide_mode is not None:
        matrices += [_spread_matrix(2 if guide_mode is GuidanceMode.FULL else 8, chunk)]
        matrices += [_spread_matrix(bs, chunk)]
    args += matrices
    in_specs += [resident(m) for m in matrices]
    out_shape = [
        jax.ShapeDtypeStruct((r, n // 2), jnp.uint8),
        jax.ShapeDtypeStruct((r, n // bs), jnp.uint8),
        jax.ShapeDtypeStruct((r, n // 8), jnp.uint8),
        jax.ShapeDtypeStruct((r, 1), jnp.float32),
    ]
    packed, bits, cbits, global_scale = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, guide_mode=guide_mode, chunk=chunk),
        grid=(r // block_r,),
        in_specs=in_specs,
        out_specs=[rows(n // 2), rows(n // bs), rows(n // 8), rows(1)],
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=False if interpret is None else interpret,
        name="fp4_quantize_mosaic",
    )(*args)
    return packed, bits, cbits, global_scale
