"""Independent float64 numpy reference of the block quantizer, using ml_dtypes casts.

It shares no code with `trace_jax.fp4`: scales follow SPEC section 2 with numpy's exact `frexp`, and
element rounding is ml_dtypes' own round-to-nearest-even cast of `x / scale` (float32, as the
quantizer computes it; every NVFP4 division is a float32 reciprocal then a product).
Float32 steps of the quantizer are mirrored by rounding exact float64
results to float32 (correct rounding of a product or quotient of float32 values).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

F32 = np.float32
E4M3_MAX = 448.0

_ELEMENT = {  # format name -> (ml_dtypes type, max value, emax for MX, sign bit)
    "mxfp4": (ml_dtypes.float4_e2m1fn, 6.0, 2, 0x8),
    "nvfp4": (ml_dtypes.float4_e2m1fn, 6.0, 2, 0x8),
    "mxfp8": (ml_dtypes.float8_e4m3fn, 448.0, 8, 0x80),
}
_BLOCK = {"mxfp4": 32, "nvfp4": 16, "mxfp8": 32}


@dataclasses.dataclass
class RefQuant:
    codes: np.ndarray  # uint8 [..., N]
    scale: np.ndarray  # float64 combined per-block scale [..., NB]
    block_scale: np.ndarray  # float64 block scale value [..., NB]
    global_scale: np.ndarray | None  # float64 [..., 1]
    values: np.ndarray  # float64 dequantized [..., N]
    z: np.ndarray  # float64 normalized x / scale before clipping [..., N]


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def element_codes(z: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """ml_dtypes RNE cast of float32 `z` (clipped to the element max): (codes, float64 values)."""
    dtype, vmax, _, sign_bit = _ELEMENT[name]
    cast = np.clip(z.astype(np.float32), -vmax, vmax).astype(dtype)
    codes = cast.view(np.uint8) & (0xF if dtype == ml_dtypes.float4_e2m1fn else 0xFF)
    codes = np.where(codes == sign_bit, 0, codes).astype(np.uint8)  # canonical +0
    return codes, cast.astype(np.float64)


def ref_quantize(x: np.ndarray, name: str) -> RefQuant:
    """Reference RTN quantization of float32 `x [..., N]`; NVFP4 global scale per row."""
    x = np.asarray(x, np.float32).astype(np.float64)
    bs = _BLOCK[name]
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // bs, bs)
    amax_b = np.max(np.abs(xb), axis=-1)
    gs = None
    if name.startswith("mx"):
        _, _, emax, _ = _ELEMENT[name]
        _, ex = np.frexp(amax_b)  # amax = m * 2**ex, m in [0.5, 1): floor(log2) = ex - 1
        e = np.where(amax_b > 0, ex - 1 - emax, -127)
        e = np.clip(e, -127, 127)
        block_scale = np.ldexp(1.0, e)
        scale = block_scale
        z = xb / scale[..., None]  # exact: power-of-two scale
    else:
        amax_g = np.max(np.abs(x), axis=-1, keepdims=True)
        gs = f32(amax_g * f32(1.0 / (6.0 * E4M3_MAX)))
        gs = np.where(amax_g > 0, np.maximum(gs, 2.0**-117), 1.0)
        raw = f32(amax_b * f32(1.0 / f32(6.0 * gs)))
        raw = np.minimum(raw, E4M3_MAX)
        block_scale = raw.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        block_scale = np.maximum(block_scale, 2.0**-9)
        scale = f32(block_scale * gs)
        z = f32(xb * f32(1.0 / scale)[..., None])
    codes, vals = element_codes(z, name)
    values = vals * scale[..., None]
    if name == "nvfp4":
        values = f32(values)
    return RefQuant(
        codes=codes.reshape(x.shape),
        scale=scale,
        block_scale=block_scale,
        global_scale=gs,
        values=values.reshape(x.shape),
        z=np.asarray(z, np.float64).reshape(x.shape),
    )


def rtn_values(z: np.ndarray, name: str) -> np.ndarray:
    """Round-to-nearest-even element values of float32 `z` (ml_dtypes cast, saturating)."""
    return element_codes(z, name)[1]


def neighbours(z: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Signed grid points `lo <= clip(z) <= hi` around each value (float64)."""
    g = grid(name)
    signed = np.unique(np.concatenate([-g, g]))
    zc = np.clip(z, signed[0], signed[-1])
    lo = signed[np.searchsorted(signed, zc, side="right") - 1]
    hi = signed[np.searchsorted(signed, zc, side="left")]
    return lo, hi


def grid(name: str) -> np.ndarray:
    """All finite non-negative element values of the format, ascending (via ml_dtypes)."""
    dtype = _ELEMENT[name][0]
    allv = np.arange(256 if dtype == ml_dtypes.float8_e4m3fn else 16, dtype=np.uint8)
    vals = allv.view(dtype).astype(np.float64)
    return np.unique(np.abs(vals[np.isfinite(vals)]))


def decode_codes(codes: np.ndarray, name: str) -> np.ndarray:
    """Signed float64 values of element codes via ml_dtypes."""
    dtype = _ELEMENT[name][0]
    return np.asarray(codes, np.uint8).view(dtype).astype(np.float64)
