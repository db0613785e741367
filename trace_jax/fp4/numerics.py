"""Exact minifloat numerics as explicit arithmetic on the grid (pure, elementwise, float32).

Nothing here uses `astype(float4_e2m1fn)`-style casts: under `jax.jit` on GPU, XLA folds
`x.astype(f4).astype(f32)` into a plain copy, so a quantizer written that way quantizes nothing.
Everything is comparisons, `floor`, multiplications by exact powers of two and float32 bit
manipulation, so the same functions also run inside Pallas kernel bodies.

All functions take magnitudes `a` already clipped to `[0, spec.max_value]` unless noted. Exactness:
`a / step` (a product with `1 / step`) and `t * step` are exact because `step` is a power of two
well inside float32's normal range, and `a - lo`, `hi - a` are exact because both operands are
multiples of `ulp(a)`.
Inputs below float32's normal range (|x| < 2**-126) are flushed to zero by XLA on CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4.formats import MiniFloatSpec

_F32_EXP_BIAS = 127
_F32_MANT_BITS = 23
# y + 2**23 (0 <= y < 2**22) is 2**23 plus y rounded to an integer, ties to even, in float32.
_ROUNDING_MAGIC = np.float32(2.0**_F32_MANT_BITS)
_ROUNDING_MAGIC_BITS = 0x4B000000  # the float32 bits of 2**23


def abs_max(x: jax.Array, axis, keepdims: bool = False) -> jax.Array:
    """float32 `max |x|` over `axis`, NaN wherever a reduced element is NaN, on every backend.

    Reduced over the bit patterns: for non-negative float32 the int32 order of the bits is the
    float order, +Inf above every finite value and every NaN above +Inf, so an integer max is the
    float max with NaN kept. A float max reduction does not promise that: XLA's CPU backend drops
    NaN from reductions of 4096 or more elements, and Triton's max ignores NaN.
    """
    bits = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis, keepdims=keepdims), jnp.float32)


def floor_log2(a: jax.Array) -> jax.Array:
    """floor(log2(a)) for positive normal float32 `a`, read from the exponent bits (int32).

    Zero and subnormals give -127; the result is exact where `jnp.log2` may round.
    """
    bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    return ((bits >> _F32_MANT_BITS) & 0xFF) - _F32_EXP_BIAS


def exp2_int(e: jax.Array) -> jax.Array:
    """2.0**e as float32 for integer `e` in [-126, 127], built from the exponent bits."""
    e = jnp.asarray(e, jnp.int32)
    bits = (e + _F32_EXP_BIAS) << _F32_MANT_BITS
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def reciprocal_rn(
    d: jax.Array, *, estimate: Callable[[jax.Array], jax.Array] | None = None
) -> jax.Array:
    """Float32 `1 / d` correctly rounded (IEEE, nearest-even), the same bits on every platform.

    NVIDIA GPUs divide with `div.full.f32` under XLA and Pallas alike, one ulp off in 13% of
    reciprocals (experiments/results/gpu_division.md), so a plain `1 / d` quantizes differently
    on the GPU than on the CPU. Off the CPU (and whenever `estimate` is given) the hardware only
    estimates the reciprocal of the mantissa and integer arithmetic settles the last bit
    (`_corrected_reciprocal`); XLA's CPU division is IEEE already, so there it is the plain
    quotient (`lax.platform_dependent`, chosen when lowering: the correction's ~30 operations per
    call made the CPU test suite's model compilations 40% slower). Both give the same bits,
    special values included (tested).

    d: float32 array, any shape. `estimate(m)`: float32 estimate of `1 / m` for m in [1, 2),
    within two ulp; None: the hardware division (the Pallas quantize kernel passes the one-
    instruction `rcp.approx`; tests pass perturbed ones). Returns float32, d's shape. Inside a
    Pallas kernel compiled for the GPU an estimate is required: the platform-dependent default
    does not lower to Triton.
    Special values get fixed bits, so that they too agree across platforms: zero and subnormal
    `d` give +-inf, +-inf gives +-0, NaN gives NaN, and `|d| > 2**126`, whose quotient is
    subnormal, gives +-0 (flushed, as XLA's CPU does).
    """
    d = jnp.asarray(d, jnp.float32)
    if estimate is not None:
        return _corrected_reciprocal(d, estimate)
    return jax.lax.platform_dependent(d, cpu=_quotient, default=_corrected_by_division)


# Module-level branches of `reciprocal_rn`'s `platform_dependent`: the same function objects on
# every call let JAX reuse their traced jaxprs for equal shapes (fresh lambdas were traced anew at
# every quantization site: a third of a tiny model's trace time).
def _quotient(d: jax.Array) -> jax.Array:
    return jnp.float32(1.0) / d


def _corrected_by_division(d: jax.Array) -> jax.Array:
    return _corrected_reciprocal(d, None)


def _corrected_reciprocal(d: jax.Array, estimate: Callable[[jax.Array], jax.Array] | None):
    """`reciprocal_rn` by a hardware estimate and an exact integer correction.

    The hardware estimates `1 / m` for the mantissa `m = Md * 2**-23` in [1, 2); with the
    estimate's 24-bit mantissa `Mr` (`1 / m ~ Mr * 2**-24`), the residual `E = 2**47 - Md * Mr`
    is exact in int32 (2**47 vanishes mod 2**32 and |E| < 2**31 for any estimate within 64 ulp),
    and each step that moves `Mr` by one towards the quotient while `|E| > Md / 2` reaches the
    nearest `Mr` (no ties: `2**48 / Md` is an odd integer only for `Md` a power of two, where the
    quotient is exact). Two steps correct an estimate up to two ulp off, `div.full.f32`'s
    documented bound. The result is built from bits: exponent field `253 - e_d`, mantissa
    `Mr - 2**23` (a carry when `Mr = 2**24`). An estimate in the next binade (above 1 for m = 1)
    is clipped back first.
    """
    bits = jax.lax.bitcast_convert_type(d, jnp.int32)
    sign = bits & jnp.int32(-(2**31))
    exp_field = (bits >> _F32_MANT_BITS) & 0xFF
    mant_field = bits & ((1 << _F32_MANT_BITS) - 1)
    md = mant_field | (1 << _F32_MANT_BITS)  # [2**23, 2**24)
    m = jax.lax.bitcast_convert_type(mant_field | (_F32_EXP_BIAS << _F32_MANT_BITS), jnp.float32)
    # 1 / m is in (0.5, 1], where float32's spacing is 2**-24: the scaled estimate is an integer.
    inverse = jnp.float32(1.0) / m if estimate is None else estimate(m)
    mr = jnp.clip((inverse * np.float32(2.0**24)).astype(jnp.int32), 1 << 23, 1 << 24)
    # 2**47 - Md * Mr mod 2**32 in uint32 (wrapping is defined there), read back as int32.
    prod = md.astype(jnp.uint32) * mr.astype(jnp.uint32)
    resid = jax.lax.bitcast_convert_type(jnp.uint32(0) - prod, jnp.int32)
    for _ in range(2):
        step = (2 * resid > md).astype(jnp.int32) - (2 * resid < -md).astype(jnp.int32)
        mr, resid = mr + step, resid - step * md
    normal = ((252 - exp_field) << _F32_MANT_BITS) + mr
    normal = jnp.where(normal >= 1 << _F32_MANT_BITS, normal, 0)  # a subnormal quotient: +-0
    inf, nan = 0x7F800000, 0x7FC00000
    special = jnp.where(exp_field == 0, inf, jnp.where(md > 1 << _F32_MANT_BITS, nan, 0))
    out = jnp.where((exp_field >= 1) & (exp_field <= 254), normal, special) | sign
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def grid_neighbours(a: jax.Array, spec: MiniFloatSpec):
    """The two grid points around each magnitude: `lo <= a <= hi`, equal when `a` is on the grid.

    Args:
      a: float32 magnitudes in `[0, spec.max_value]` (NaN passes through as NaN `lo`/`hi`).
      spec: the element minifloat.

    Returns:
      `(lo, hi, lo_idx, hi_idx)`: float32 grid values and their int32 magnitude codes
      (`hi_idx == lo_idx + 1` unless `a` is on the grid).
    """
    m_bits = spec.mantissa_bits
    e = jnp.maximum(floor_log2(a), spec.min_exponent)
    step = exp2_int(e - m_bits)
    # a / step as a multiplication by the exact inverse power of two (same value; a true float32
    # division costs several instructions per element on GPUs).
    t = jnp.floor(a * exp2_int(m_bits - e))
    lo = t * step
    on_grid = lo == a
    hi = jnp.where(on_grid, lo, lo + step)
    t_int = jnp.where(jnp.isnan(t), 0.0, t).astype(jnp.int32)
    lo_idx = (e - spec.min_exponent) * (1 << m_bits) + t_int
    hi_idx = lo_idx + jnp.where(on_grid, 0, 1)
    return lo, hi, lo_idx, hi_idx


def nearest_even_index(a: jax.Array, spec: MiniFloatSpec) -> jax.Array:
    """Magnitude code (int32) of the grid point nearest to `a`, ties to the even code.

    The same codes as `select_nearest_even(a, *grid_neighbours(a, spec))` in about a third of the
    instructions (the quantize kernel is instruction-bound on this step): within `a`'s binade the
    grid is the integers times `step`, so `a / step` is rounded to an integer by adding 2**23 in
    float32 (whose rounding is nearest-even; the integer lands in the low mantissa bits). Codes
    count grid points, so `(e - min_exponent) << mantissa_bits` plus that integer is the code, a
    round-up to the next binade included; the codes' parity is the integer's (mantissa_bits >= 1),
    so ties go to the even code. NaN gives an unspecified code (callers mask it).
    """
    m_bits = spec.mantissa_bits
    e = jnp.maximum(floor_log2(a), spec.min_exponent)
    y = a * exp2_int(m_bits - e)  # exact: a power-of-two product, in [0, 2**(m_bits + 1)]
    t = jax.lax.bitcast_convert_type(y + _ROUNDING_MAGIC, jnp.int32) - _ROUNDING_MAGIC_BITS
    return ((e - spec.min_exponent) << m_bits) + t


def select_nearest_even(a, lo, hi, lo_idx, hi_idx):
    """Round to nearest, ties to the even magnitude code (zero mantissa LSB). Returns int32 idx."""
    d_lo = a - lo
    d_hi = hi - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo_idx & 1) == 1))
    return jnp.where(take_hi, hi_idx, lo_idx)


def select_stochastic(a, lo, hi, lo_idx, hi_idx, u):
    """Unbiased stochastic rounding: `hi` with probability `(a - lo) / (hi - lo)`; u ~ U[0, 1)."""
    width = hi - lo
    p_hi = jnp.where(width > 0, (a - lo) / jnp.where(width > 0, width, 1.0), 0.0)
    return jnp.where(u < p_hi, hi_idx, lo_idx)


def select_toward(lo, hi, lo_idx, hi_idx, target, rtn_idx):
    """Of `lo`/`hi`, the one nearest `target` (a magnitude mirrored to `a`'s side of zero).

    `target` is the rollout's value expressed on the same half-line as `a`: `+|r|` when the rollout
    value has the sign of the trainer value (or is zero), `-|r|` otherwise. Since `lo` and `hi` are
    adjacent grid points, `target` lies at or beyond one of them unless `lo == hi`; in that case
    `rtn_idx` (which then equals both) is kept.
    """
    return jnp.where(target <= lo, lo_idx, jnp.where(target >= hi, hi_idx, rtn_idx))


def select_by_bit(lo_idx, hi_idx, bit):
    """Of the adjacent `lo`/`hi`, the one whose mantissa LSB equals the rollout's `bit` (0 or 1)."""
    return jnp.where((lo_idx & 1) == bit.astype(jnp.int32), lo_idx, hi_idx)


def magnitude_value(idx: jax.Array, spec: MiniFloatSpec) -> jax.Array:
    """Grid value (float32, >= 0) of magnitude code `idx` (int), the inverse of grid_neighbours."""
    idx = idx.astype(jnp.int32)
    m_bits = spec.mantissa_bits
    e_field = idx >> m_bits
    m = (idx & ((1 << m_bits) - 1)).astype(jnp.float32)
    sub = m * exp2_int(jnp.full_like(idx, spec.min_exponent - m_bits))
    normal = ((1 << m_bits) + m) * exp2_int(e_field - spec.bias - m_bits)
    return jnp.where(e_field == 0, sub, normal)


def encode(sign: jax.Array, idx: jax.Array, spec: MiniFloatSpec) -> jax.Array:
    """Code `sign << sign_shift | idx` (int32, below 256), zero always encoded as +0 (code 0).
    int32 rather than uint8: Mosaic kernels avoid 8-bit vector arithmetic; callers cast."""
    idx = idx.astype(jnp.int32)
    return jnp.where(idx == 0, 0, sign.astype(jnp.int32) << spec.sign_shift) | idx


def decode(codes: jax.Array, spec: MiniFloatSpec) -> jax.Array:
    """Signed float32 value of each code (uint8). Codes above `max_code` (E4M3's NaN) give NaN."""
    codes = codes.astype(jnp.int32)
    idx = codes & ((1 << spec.sign_shift) - 1)
    mag = magnitude_value(idx, spec)
    mag = jnp.where(idx > spec.max_code, jnp.nan, mag)
    return jnp.where((codes >> spec.sign_shift) & 1 == 1, -mag, mag)


def round_nearest_even(x: jax.Array, spec: MiniFloatSpec) -> jax.Array:
    """Round float32 `x` to the nearest grid value (ties to even, saturating), as float32."""
    a = jnp.minimum(jnp.abs(x), spec.max_value)
    mag = magnitude_value(nearest_even_index(a, spec), spec)
    return jnp.where(jnp.isnan(x), jnp.nan, jnp.where(x < 0, -mag, mag))


_E4M3_TO_F32_EXP = (_F32_EXP_BIAS - 7) << _F32_MANT_BITS  # float32 exponent bias minus E4M3's


def decode_e4m3_bits(bits: jax.Array) -> jax.Array:
    """Float32 value of E4M3 bits (uint8 or int), the same as `decode(bits, E4M3 spec)` (NaN for
    0x7F / 0xFF, -0 for 0x80) in fewer instructions: a normal E4M3 number's exponent and mantissa
    fields, shifted to float32's positions, are its float32 bits less the bias difference; the
    eight subnormals are `mantissa * 2**-9`."""
    b = jnp.asarray(bits).astype(jnp.int32)
    mag_bits = b & 0x7F
    normal = jax.lax.bitcast_convert_type((mag_bits << 20) + _E4M3_TO_F32_EXP, jnp.float32)
    mag = jnp.where(mag_bits < 8, mag_bits.astype(jnp.float32) * np.float32(2.0**-9), normal)
    mag = jnp.where(mag_bits == 0x7F, jnp.nan, mag)
    return jnp.where(b >= 0x80, -mag, mag)


def encode_e8m0(e: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """E8M0 bits (int32, 0-255) of 2**e, e clamped to [-127, 127]; NaN (0xFF) where `nonfinite`."""
    return jnp.where(nonfinite, 0xFF, jnp.clip(e, -127, 127) + 127)


def decode_e8m0(bits: jax.Array) -> jax.Array:
    """Float32 value of E8M0 bits: 2**(bits - 127), NaN for 0xFF (2**-127 is float32-subnormal)."""
    b = bits.astype(jnp.int32)
    normal = exp2_int(jnp.maximum(b - 127, -126))
    value = jnp.where(b == 0, normal * 0.5, normal)
    return jnp.where(b == 0xFF, jnp.nan, value)
