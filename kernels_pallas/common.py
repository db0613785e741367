"""Shared pieces of the Pallas kernels: backend choice, Triton compiler params, in-kernel decode.

Every kernel package (`kernels_pallas/<op>/`) has a plain-jnp `reference.py`, a Pallas `kernel.py`
and an `api.py` that picks a backend: "pallas" (Triton lowering on a GPU, interpret mode
elsewhere), "xla" (the reference), or "auto" (Pallas where it runs natively, else the reference).

In-kernel decoding reuses `trace_jax.fp4.numerics` (comparisons, shifts, float32 bit fields: all
Pallas-friendly), so kernels and the quantizer share one definition of every format. Block scales
enter kernels as their uint8 bit patterns (Triton has no E8M0 type).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

from trace_jax.fp4 import BlockFormat, ElementType, ScaleType, numerics


class Backend(enum.StrEnum):
    AUTO = "auto"
    PALLAS = "pallas"
    XLA = "xla"


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU (where Pallas lowers through Triton)."""
    return jax.default_backend() == "gpu"


def resolve_backend(backend: str | Backend, interpret: bool | None) -> tuple[Backend, bool]:
    """Returns (backend to run, whether Pallas runs in interpret mode).

    "auto" runs Pallas natively on a GPU and the XLA reference elsewhere; "pallas" off the GPU runs
    in interpret mode (how CI tests the kernels on the CPU).
    """
    backend = Backend(backend)
    if backend is Backend.AUTO:
        backend = Backend.PALLAS if on_gpu() else Backend.XLA
    if interpret is None:
        interpret = not on_gpu()
    return backend, interpret


def triton_params(num_warps: int = 4, num_stages: int = 2) -> pl_triton.CompilerParams:
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def scale_bits(scales: jax.Array) -> jax.Array:
    """Block scales (float8_e8m0fnu / float8_e4m3fn) as their uint8 bit patterns."""
    return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def decode_scale_bits(bits: jax.Array, fmt: BlockFormat) -> jax.Array:
    """float32 block-scale values from uint8 bits, inside or outside a kernel."""
    if fmt.scale is ScaleType.E8M0:
        return numerics.decode_e8m0(bits)
    return numerics.decode(bits, ElementType.E4M3.spec)


def unpack_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(low, high) 4-bit codes of packed bytes: elements 2i and 2i + 1 (see `fp4.pack_fp4`)."""
    p = packed.astype(jnp.int32)
    return p & 0xF, (p >> 4) & 0xF


# E2M1 code bits (s, e1, e0, m) moved to E4M3 bit positions (7, 4, 3, 2) give an E4M3 number equal
# to the E2M1 value times 2**-6 for all 16 codes, the subnormal 0.5 included (E4M3's exponent bias
# 7 exceeds E2M1's by 6, and its subnormal step 2**-9 is E2M1's 0.5 times 2**-6). So decoding is a
# few bitwise ops per packed byte plus the hardware FP8 -> bf16 conversion: no per-element compare
# or select chain, which is what makes FP4 decode cost more than its bytes on Hopper.
E4M3_ALIGN = 2.0**-6


def as_e4m3(bits: jax.Array) -> jax.Array:
    """uint8 E4M3 bit patterns as float8_e4m3fn (a bitcast)."""
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)


def e2m1_codes_as_e4m3(codes: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, one per byte in the low nibble) as float8_e4m3fn, value * 2**-6."""
    return as_e4m3(((codes << 2) & 0x1C) | ((codes << 4) & 0x80))


def fp4_planes_as_e4m3(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(low, high) nibble planes of packed E2M1 bytes as float8_e4m3fn, each value * 2**-6.

    `packed` uint8 [..., n] (element 2i in the low nibble of byte i) -> two float8_e4m3fn [..., n]:
    the even and the odd elements. Exact: every E2M1 value times 2**-6 is an E4M3 number.
    """
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    # The low nibble's formula ignores bits 4-7, so it applies to the packed byte as is.
    return e2m1_codes_as_e4m3(packed), as_e4m3(((packed >> 2) & 0x1C) | (packed & 0x80))


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """float32 values of E2M1 codes (int), the quantizer's own decode."""
    return numerics.decode(codes, ElementType.E2M1.spec)
