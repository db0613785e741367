"""Block scales (calibrate -> scale), SPEC section 2, as pure functions on float32 arrays.

Axis legend: `[..., NB, BS]` is a tensor viewed as NB blocks of BS elements along its last axis.

Rules:
  MX (E8M0):   e = floor(log2(amax_block)) - emax_elem, clamped to [-127, 127]; X = 2**e.
  NVFP4:       s_g = amax_global / (6 * 448);  s_b = e4m3(amax_block / (6 * s_g)), RNE, <= 448.
Float32 recipe (what "/" means above, bit for bit): `s_g = amax * f32(1/2688)`,
`s_b = e4m3(amax_b * (1 / f32(6 * s_g)))`, `x / scale = x * (1 / f32(s_b * s_g))`: every division
is a float32 reciprocal followed by a multiplication. The reciprocal is correctly rounded on every
platform (`numerics.reciprocal_rn`): NVIDIA GPUs divide approximately (`div.full.f32`, one ulp
off in 13% of cases on the H200, experiments/results/gpu_division.md), so a plain `1 / d` made
NVFP4 codes differ between CPU and GPU in 1-2e-4 of elements (platform_numerics.md); with the
exact reciprocal the CPU, XLA on the GPU and the Pallas kernels give the same bits.
Edge cases (documented contract, mirrored by the float64 test reference):
  * an all-zero block gets the smallest scale (E8M0 2**-127, E4M3 2**-9) and codes 0;
  * an NVFP4 block scale that rounds to zero is raised to 2**-9; a global amax of zero gives
    s_g = 1, and s_g is at least 2**-117 so that s_b * s_g stays a normal float32;
  * a block (or NVFP4 global group) holding NaN or Inf gets a NaN scale, so every dequantized value
    of that block is NaN: no finite number ever stands in for a NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4 import numerics
from trace_jax.fp4.formats import BlockFormat, ElementType, ScaleType

_E4M3 = ElementType.E4M3.spec
_E4M3_NAN = 0x7F
_E4M3_MIN_SCALE_CODE = 1  # 2**-9, E4M3's smallest subnormal
# Smallest global scale: keeps s_b * s_g >= 2**-9 * 2**-117 inside float32's normal range (XLA
# flushes subnormals, which would turn the combined scale into zero).
_MIN_GLOBAL_SCALE = 2.0**-117
# An estimate of 1 / m for float32 m in [1, 2) (`numerics.reciprocal_rn`).
Estimate = Callable[[jax.Array], jax.Array]


def reciprocal(d: jax.Array, estimate: Estimate | None = None) -> jax.Array:
    """Float32 `1 / d`, correctly rounded on every platform (`numerics.reciprocal_rn`, whose
    `estimate` of a mantissa's reciprocal changes only the speed, never the bits).

    Scaling multiplies by this reciprocal instead of dividing: XLA may rewrite a division by a
    broadcast value into exactly this form anyway, so writing it explicitly pins the arithmetic.
    """
    return numerics.reciprocal_rn(d, estimate=estimate)


def normalize_global_axes(global_axes: tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    """Positive, sorted global-scale axes; they must include the last (blocked) axis."""
    if global_axes is None:
        return tuple(range(ndim))
    axes = []
    for ax in global_axes:
        if not -ndim <= ax < ndim:
            raise ValueError(f"global_axes {global_axes} out of range for a {ndim}-d tensor")
        axes.append(ax % ndim)
    if ndim - 1 not in axes:
        raise ValueError(
            f"global_axes {global_axes} must include the last axis: every block needs one global "
            "scale"
        )
    return tuple(sorted(set(axes)))


def global_scale(x: jax.Array, fmt: BlockFormat, axes: tuple[int, ...]) -> jax.Array:
    """NVFP4 float32 global scale `amax / (6 * 448)` over `axes` (kept as size-1 dims)."""
    return global_scale_from_amax(numerics.abs_max(x, axes, keepdims=True), fmt)


def global_scale_from_amax(amax: jax.Array, fmt: BlockFormat) -> jax.Array:
    """`global_scale` from the max |x| already taken (e.g. over a row's column chunks)."""
    s_g = amax * np.float32(1.0 / (fmt.elem.max_value * _E4M3.max_value))
    s_g = jnp.where(amax > 0, jnp.maximum(s_g, _MIN_GLOBAL_SCALE), 1.0)
    return jnp.where(jnp.isfinite(amax), s_g, jnp.nan).astype(jnp.float32)


def block_scale_bits(
    xb: jax.Array, fmt: BlockFormat, s_g: jax.Array | None, *, estimate: Estimate | None = None
) -> jax.Array:
    """Block-scale bit patterns (uint8 `[..., NB]`) from blocked float32 `xb [..., NB, BS]`.

    `s_g` is the global scale broadcastable to `[..., NB]` (NVFP4), else None. Bits rather than
    float8 arrays, so that Pallas kernels (Triton has no E8M0 type) run the same code.
    `estimate`: `reciprocal`'s.
    """
    amax = numerics.abs_max(xb, -1)
    return block_scale_bits_from_amax(amax, fmt, s_g, estimate=estimate).astype(jnp.uint8)


def block_scale_bits_from_amax(
    amax: jax.Array, fmt: BlockFormat, s_g: jax.Array | None, *, estimate: Estimate | None = None
) -> jax.Array:
    """`block_scale_bits` from each block's max |x| already taken (`numerics.abs_max`).

    amax: float32, any shape (`[..., NB]`, or a kernel's `[R, W]` holding every lane's block
    max); `s_g` broadcastable to it (NVFP4), else None; `estimate`: `reciprocal`'s.
    Returns int32 bit patterns (0-255) of amax's shape: int32 so that kernels without 8-bit
    vector arithmetic (Mosaic) use them as they are.
    """
    nonfinite = ~jnp.isfinite(amax)
    if fmt.scale is ScaleType.E8M0:
        e = numerics.floor_log2(amax) - fmt.elem.max_exponent
        return numerics.encode_e8m0(e, nonfinite)
    raw = amax * reciprocal(np.float32(fmt.elem.max_value) * s_g, estimate)
    raw = jnp.minimum(raw, _E4M3.max_value)
    # Code 1 is 2**-9, the smallest scale: a scale rounding to zero is raised to it.
    idx = jnp.maximum(numerics.nearest_even_index(raw, _E4M3), _E4M3_MIN_SCALE_CODE)
    return jnp.where(nonfinite | jnp.isnan(raw), _E4M3_NAN, idx)


def to_bits(scales: jax.Array) -> jax.Array:
    """Float8 block scales -> their uint8 bit patterns."""
    return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def from_bits(bits: jax.Array, fmt: BlockFormat) -> jax.Array:
    """uint8 bit patterns -> block scales in `fmt.scale_dtype`."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), fmt.scale_dtype)


def scale_bits_to_float32(bits: jax.Array, fmt: BlockFormat) -> jax.Array:
    """Block-scale bits (uint8) -> float32 values (NaN scales stay NaN)."""
    if fmt.scale is ScaleType.E8M0:
        return numerics.decode_e8m0(bits)
    return numerics.decode_e4m3_bits(bits)


def scales_to_float32(scales: jax.Array, fmt: BlockFormat) -> jax.Array:
    """Block scales in `fmt.scale_dtype` -> float32 values (NaN scales stay NaN)."""
    return scale_bits_to_float32(to_bits(scales), fmt)


def normalize(
    xb: jax.Array,
    bits: jax.Array,
    s_g: jax.Array | None,
    fmt: BlockFormat,
    *,
    estimate: Estimate | None = None,
):
    """`x / scale` per element: `xb [..., NB, BS]` float32 -> float32; `bits` uint8 `[..., NB]`;
    `estimate`: `reciprocal`'s."""
    return xb * inverse_scale(bits, s_g, fmt, estimate=estimate)[..., None]


def inverse_scale(
    bits: jax.Array, s_g: jax.Array | None, fmt: BlockFormat, *, estimate: Estimate | None = None
) -> jax.Array:
    """float32 `1 / scale` of block-scale bits (any integer dtype, any shape: `[..., NB]`, or a
    kernel's `[R, W]` holding every lane's block scale); `s_g` broadcastable to it (NVFP4), else
    None; `estimate`: `reciprocal`'s. NaN for a NaN scale.

    MX scales are powers of two, so the inverse is exact (this also keeps the all-zero block's
    2**-127 scale, a float32 subnormal, out of the arithmetic).
    """
    if fmt.scale is ScaleType.E8M0:
        e = bits.astype(jnp.int32) - 127
        inv = numerics.exp2_int(jnp.clip(-e, -126, 127))
        return jnp.where(bits == 0xFF, jnp.nan, inv)
    combined = scale_bits_to_float32(bits, fmt) * s_g
    return reciprocal(combined, estimate)


def denormalize(qb: jax.Array, bits: jax.Array, s_g: jax.Array | None, fmt: BlockFormat):
    """`q * scale` per element: grid values `qb [..., NB, BS]` float32 -> float32."""
    if fmt.scale is ScaleType.E8M0:
        # 2**-127 is a float32 subnormal (flushed to zero by XLA): apply it as 2**-126 * 0.5 so
        # only a subnormal *result* is flushed.
        e = bits.astype(jnp.int32) - 127
        factor = jnp.where(bits == 0xFF, jnp.nan, numerics.exp2_int(jnp.maximum(e, -126)))
        out = qb * factor[..., None]
        return jnp.where((bits == 0)[..., None], out * 0.5, out)
    factor = scale_bits_to_float32(bits, fmt) * s_g
    return qb * factor[..., None]
