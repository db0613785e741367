"""`quantize` / `dequantize`: the one quantizer used by tests, rollout, training and kernel refs.

Blocks run along the last axis. Rounding is explicit arithmetic on the element grid
(`trace_jax.fp4.numerics`); see that module for why casts are never used.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from trace_jax.fp4 import numerics, scales
from trace_jax.fp4.formats import BlockFormat, get_format
from trace_jax.fp4.guidance import Guidance, GuidanceMode
from trace_jax.fp4.qtensor import QTensor, blocks_shape


class Rounding(enum.StrEnum):
    RTN = "rtn"  # round to nearest, ties to even, saturating
    STOCHASTIC = "stochastic"  # unbiased, needs `key`
    GUIDED = "guided"  # rollout-guided (SPEC 4, 5), needs `guidance`


def _check_arguments(x, fmt: BlockFormat, rounding: Rounding, key, guidance) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize expects a floating-point array, got {x.dtype}")
    blocks_shape(x.shape, fmt)
    if rounding is Rounding.STOCHASTIC and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key`")
    if rounding is not Rounding.STOCHASTIC and key is not None:
        raise ValueError(f"a `key` is only used by rounding='stochastic', not {rounding.value!r}")
    if rounding is Rounding.GUIDED:
        if guidance is None:
            raise ValueError("rounding='guided' needs the rollout's `guidance`")
        if not isinstance(guidance, Guidance):
            raise TypeError(f"guidance must be a trace_jax.fp4.Guidance, got {type(guidance)}")
        guidance.check_matches(x.shape, fmt)
    elif guidance is not None:
        raise ValueError(f"`guidance` is only used by rounding='guided', not {rounding.value!r}")


def _rollout_target(guidance: Guidance, sign, block_shape, spec) -> jax.Array:
    """The rollout's value as a magnitude on the trainer value's side of zero (select_toward)."""
    r = guidance.rollout_codes().reshape(block_shape).astype(jnp.int32)
    r_idx = r & ((1 << spec.sign_shift) - 1)
    r_neg = (r >> spec.sign_shift) & 1 == 1
    r_mag = numerics.magnitude_value(r_idx, spec)
    same_side = (r_neg == sign) | (r_idx == 0)
    return jnp.where(same_side, r_mag, -r_mag)


def quantize(
    x: jax.Array,
    fmt: str | BlockFormat,
    *,
    rounding: str | Rounding = "rtn",
    key: jax.Array | None = None,
    guidance: Guidance | None = None,
    global_axes: tuple[int, ...] | None = (-1,),
) -> QTensor:
    """Block-quantizes `x` along its last axis.

    Args:
      x: floating `[..., N]`, N a multiple of `fmt.block_size`. Computed in float32.
      fmt: a `BlockFormat` or its name ("mxfp4" | "nvfp4" | "mxfp8").
      rounding: "rtn" | "stochastic" | "guided".
      key: PRNG key for stochastic rounding.
      guidance: the rollout's `Guidance` for guided rounding; its scales replace the trainer's own
        on rows it covers (`guidance.mask`), and its codes (full) or mantissa bits (compact) pick
        between the two grid neighbours of `x / scale`.
      global_axes: NVFP4 only: axes sharing one global scale; they must include the last axis.
        Default: one global scale per row. None: one for the whole tensor.

    Returns:
      A `QTensor` with codes uint8 `[..., N]`. NaN/Inf inputs give a NaN scale for their block
      (and NVFP4 global group), so they dequantize to NaN.
    """
    fmt = get_format(fmt)
    rounding = Rounding(rounding)
    x = jnp.asarray(x)
    _check_arguments(x, fmt, rounding, key, guidance)
    spec = fmt.elem
    nb_shape = blocks_shape(x.shape, fmt)
    block_shape = (*nb_shape, fmt.block_size)

    x32 = x.astype(jnp.float32)
    s_g = None
    if fmt.has_global_scale:
        axes = scales.normalize_global_axes(global_axes, x.ndim)
        s_g = scales.global_scale(x32, fmt, axes)
    xb = x32.reshape(block_shape)
    s_b = scales.block_scales(xb, fmt, s_g)

    guided_rows = None
    if rounding is Rounding.GUIDED:
        guided_rows = True if guidance.mask is None else guidance.mask
        row = guided_rows if guidance.mask is None else guided_rows[..., None]
        s_b = jnp.where(row, guidance.scales, s_b)
        if s_g is not None:
            s_g = jnp.where(row, guidance.global_scale, s_g)

    z = scales.normalize(xb, s_b, s_g, fmt)
    a = jnp.minimum(jnp.abs(z), spec.max_value)
    sign = z < 0
    lo, hi, lo_idx, hi_idx = numerics.grid_neighbours(a, spec)
    idx = numerics.select_nearest_even(a, lo, hi, lo_idx, hi_idx)

    if rounding is Rounding.STOCHASTIC:
        u = jax.random.uniform(key, a.shape, jnp.float32)
        idx = numerics.select_stochastic(a, lo, hi, lo_idx, hi_idx, u)
    elif rounding is Rounding.GUIDED:
        if guidance.mode is GuidanceMode.FULL:
            target = _rollout_target(guidance, sign, block_shape, spec)
            guided_idx = numerics.select_toward(lo, hi, lo_idx, hi_idx, target, idx)
        else:
            bits = guidance.mantissa_bits().reshape(block_shape)
            guided_idx = numerics.select_by_bit(lo_idx, hi_idx, bits)
        if guidance.mask is not None:
            guided_idx = jnp.where(guidance.mask[..., None, None], guided_idx, idx)
        idx = guided_idx

    idx = jnp.where(jnp.isnan(a), 0, idx)
    codes = numerics.encode(sign, idx, spec).reshape(x.shape)
    return QTensor(codes=codes, scales=s_b, global_scale=s_g, fmt=fmt)


def dequantize(q: QTensor, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Values of `q` as `dtype` `[..., N]`: code value times block scale (times global scale)."""
    fmt = q.fmt
    block_shape = (*blocks_shape(q.shape, fmt), fmt.block_size)
    values = numerics.decode(q.codes, fmt.elem).reshape(block_shape)
    out = scales.denormalize(values, q.scales, q.global_scale, fmt)
    return out.reshape(q.shape).astype(dtype)
