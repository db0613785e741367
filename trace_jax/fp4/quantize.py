"""`quantize` / `dequantize`: the one quantizer used by tests, rollout, training and kernel refs.

Blocks run along the last axis. Rounding is explicit arithmetic on the element grid
(`trace_jax.fp4.numerics`); see that module for why casts are never used.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from trace_jax.fp4 import numerics, scales
from trace_jax.fp4.formats import BlockFormat, MiniFloatSpec, get_format
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


def quantize_core(
    x32: jax.Array,
    fmt: BlockFormat,
    *,
    s_g: jax.Array | None,
    rounding: Rounding = Rounding.RTN,
    u: jax.Array | None = None,
    guide_codes: jax.Array | None = None,
    guide_bits: jax.Array | None = None,
    guide_scale_bits: jax.Array | None = None,
    guide_global: jax.Array | None = None,
    guide_rows: jax.Array | None = None,
    scale_bits: jax.Array | None = None,
    reciprocal_estimate: scales.Estimate | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The quantizer on plain arrays, shared by `quantize`, the Pallas kernels and PTQ.

    Args:
      x32: float32 `[..., N]`, N a multiple of the block.
      fmt: the format.
      s_g: the trainer's own NVFP4 global scale broadcastable to `[..., 1]`, else None.
      rounding: RTN, STOCHASTIC (with `u ~ U[0, 1)` of x's shape) or GUIDED.
      guide_codes / guide_bits: GUIDED: the rollout's codes (full) or mantissa bits (compact),
        uint8 `[..., N]` (exactly one of them).
      guide_scale_bits, guide_global: the rollout's block-scale bits `[..., NB]` and global scale,
        used wherever the trainer's own are not NaN.
      guide_rows: bool `[...]` rows that carry guidance (None: all).
      scale_bits: block-scale bits uint8 `[..., NB]` to use instead of the max-abs rule (scale
        search in `trace_jax.quant.ptq`); None computes them.
      reciprocal_estimate: the hardware estimate inside `scales.reciprocal` (speed only: the
        reciprocal is correctly rounded whatever it is); None: a float32 division.

    Returns:
      `(codes uint8 [..., N], scale bits uint8 [..., NB], global scale or None)`.
    """
    nb = x32.shape[-1] // fmt.block_size
    block_shape = (*x32.shape[:-1], nb, fmt.block_size)
    xb = x32.reshape(block_shape)
    est = reciprocal_estimate
    bits = scale_bits
    if bits is None:
        bits = scales.block_scale_bits(xb, fmt, s_g, estimate=est)

    if rounding is Rounding.GUIDED:
        row = True if guide_rows is None else guide_rows[..., None]
        bits, s_g = rollout_scales(bits, s_g, fmt, guide_scale_bits, guide_global, rows=row)

    z = scales.normalize(xb, bits, s_g, fmt, estimate=est)

    def blocked(v):
        return None if v is None else v.reshape(block_shape)

    codes = round_to_codes(
        z,
        fmt.elem,
        rounding=rounding,
        u=blocked(u),
        guide_codes=blocked(guide_codes),
        guide_bits=blocked(guide_bits),
        guide_rows=None if guide_rows is None else guide_rows[..., None, None],
    )
    return codes.astype(jnp.uint8).reshape(x32.shape), bits, s_g


def rollout_scales(
    bits: jax.Array,
    s_g: jax.Array | None,
    fmt: BlockFormat,
    guide_scale_bits: jax.Array,
    guide_global: jax.Array | None,
    *,
    rows: jax.Array | bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """The scales guided rounding uses: the rollout's block-scale bits and global scale in place
    of the trainer's own, except where those are NaN (the block or its NVFP4 global group holds
    NaN or Inf): guided rounding marks the blocks RTN marks, and no finite number stands in for
    the trainer's NaN.

    bits, guide_scale_bits: integer block-scale bits `[..., NB]` (or a kernel's `[R, W]` holding
    every lane's block scale); s_g, guide_global: float32 global scales broadcastable to
    `[..., 1]`, or None (MX). rows: bool broadcastable to `[..., 1]`, the rows that carry
    guidance (True: all). Returns `(bits, s_g)` to round with.
    """
    own_nan = jnp.isnan(scales.scale_bits_to_float32(bits, fmt))
    bits = jnp.where(rows & ~own_nan, guide_scale_bits, bits)
    if s_g is not None:
        s_g = jnp.where(rows & ~jnp.isnan(s_g), guide_global, s_g)
    return bits, s_g


def round_to_codes(
    z: jax.Array,
    spec: MiniFloatSpec,
    *,
    rounding: Rounding = Rounding.RTN,
    u: jax.Array | None = None,
    guide_codes: jax.Array | None = None,
    guide_bits: jax.Array | None = None,
    guide_rows: jax.Array | None = None,
) -> jax.Array:
    """`quantize_core`'s rounding step: codes of the normalized `z = x / scale` on `spec`'s grid.

    Args:
      z: float32, any shape (`[..., NB, BS]`, or a kernel's `[R, W]`).
      spec: the element minifloat.
      rounding: RTN (nearest, ties to even, saturating), STOCHASTIC (with `u ~ U[0, 1)` of z's
        shape) or GUIDED.
      guide_codes / guide_bits: GUIDED: the rollout's codes (full) or mantissa bits (compact),
        integers of z's shape (exactly one of them). A full code picks the grid neighbour nearest
        the rollout's value, a compact bit the neighbour with that mantissa LSB.
      guide_rows: GUIDED: bool broadcastable to z, the elements that follow the guidance (the
        others round to nearest); None: all.

    Returns:
      int32 codes `sign << sign_shift | magnitude code` (below 256) of z's shape, zero as +0 and
      NaN as code 0 (its block's NaN scale marks it): int32 so that kernels without 8-bit vector
      arithmetic (Mosaic) use them as they are.
    """
    a = jnp.minimum(jnp.abs(z), spec.max_value)
    negative = (z < 0).astype(jnp.int32)
    if rounding is Rounding.RTN:
        idx = numerics.nearest_even_index(a, spec)
    else:  # the two grid neighbours to choose from; nearest-even among them, as cheap here
        lo, hi, lo_idx, hi_idx = numerics.grid_neighbours(a, spec)
        idx = numerics.select_nearest_even(a, lo, hi, lo_idx, hi_idx)

    if rounding is Rounding.STOCHASTIC:
        idx = numerics.select_stochastic(a, lo, hi, lo_idx, hi_idx, u)
    elif rounding is Rounding.GUIDED:
        if guide_codes is not None:
            r = guide_codes.astype(jnp.int32)
            r_idx = r & ((1 << spec.sign_shift) - 1)
            r_neg = (r >> spec.sign_shift) & 1
            r_mag = numerics.magnitude_value(r_idx, spec)
            # The rollout's value as a magnitude on the trainer value's side of zero.
            target = jnp.where((r_neg == negative) | (r_idx == 0), r_mag, -r_mag)
            guided_idx = numerics.select_toward(lo, hi, lo_idx, hi_idx, target, idx)
        else:
            guided_idx = numerics.select_by_bit(lo_idx, hi_idx, guide_bits)
        if guide_rows is not None:
            guided_idx = jnp.where(guide_rows, guided_idx, idx)
        idx = guided_idx

    idx = jnp.where(jnp.isnan(a), 0, idx)
    return numerics.encode(negative, idx, spec)


# `quantize` runs the core as a nested jit: a model has many quantization sites of few distinct
# shapes, and the nested jit traces and lowers each (shape, format, rounding) once and calls it
# from every site (XLA inlines the calls): a third less trace, lower and compile time for a
# `tiny` rollout on the CPU (17 s -> 12 s), the same computation.
_quantize_core_jit = jax.jit(quantize_core, static_argnames=("fmt", "rounding"))


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
      (and NVFP4 global group), so they dequantize to NaN; guided rounding too, where the
      trainer's NaN scale overrides the rollout's.
    """
    fmt = get_format(fmt)
    rounding = Rounding(rounding)
    x = jnp.asarray(x)
    _check_arguments(x, fmt, rounding, key, guidance)
    x32 = x.astype(jnp.float32)
    s_g = None
    if fmt.has_global_scale:
        axes = scales.normalize_global_axes(global_axes, x.ndim)
        s_g = scales.global_scale(x32, fmt, axes)
    kwargs = {}
    if rounding is Rounding.STOCHASTIC:
        kwargs["u"] = jax.random.uniform(key, x.shape, jnp.float32)
    elif rounding is Rounding.GUIDED:
        if guidance.mode is GuidanceMode.FULL:
            kwargs["guide_codes"] = guidance.rollout_codes()
        else:
            kwargs["guide_bits"] = guidance.mantissa_bits()
        kwargs.update(
            guide_scale_bits=scales.to_bits(guidance.scales),
            guide_global=guidance.global_scale,
            guide_rows=guidance.mask,
        )
    codes, bits, s_g = _quantize_core_jit(x32, fmt, s_g=s_g, rounding=rounding, **kwargs)
    return QTensor(codes=codes, scales=scales.from_bits(bits, fmt), global_scale=s_g, fmt=fmt)


def dequantize(q: QTensor, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Values of `q` as `dtype` `[..., N]`: code value times block scale (times global scale)."""
    fmt = q.fmt
    block_shape = (*blocks_shape(q.shape, fmt), fmt.block_size)
    values = numerics.decode(q.codes, fmt.elem).reshape(block_shape)
    out = scales.denormalize(values, scales.to_bits(q.scales), q.global_scale, fmt)
    return out.reshape(q.shape).astype(dtype)
