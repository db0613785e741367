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


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """float32 values of E2M1 codes (int), the quantizer's own decode."""
    return numerics.decode(codes, ElementType.E2M1.spec)
