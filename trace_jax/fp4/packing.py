"""Bit packing along the last axis: FP4 codes two per byte, guidance bits eight per byte."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_last_axis(x: jax.Array, multiple: int, what: str) -> None:
    if x.ndim == 0 or x.shape[-1] % multiple:
        raise ValueError(
            f"{what}: the last axis must be a multiple of {multiple}, got shape {x.shape}"
        )


def pack_fp4(codes: jax.Array) -> jax.Array:
    """Packs 4-bit codes two per byte: element 2i in the low nibble, 2i+1 in the high nibble.

    Args:
      codes: uint8 `[..., N]`, N even, values < 16 (higher bits are dropped).

    Returns:
      uint8 `[..., N // 2]`.
    """
    _check_last_axis(codes, 2, "pack_fp4")
    c = codes.astype(jnp.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_fp4`: uint8 `[..., M]` -> uint8 `[..., 2 * M]`."""
    p = packed.astype(jnp.uint8)
    both = jnp.stack([p & 0xF, p >> 4], axis=-1)
    return both.reshape(*p.shape[:-1], 2 * p.shape[-1])


_BIT_WEIGHTS = tuple(1 << j for j in range(8))


def pack_bits(bits: jax.Array) -> jax.Array:
    """Packs 0/1 values eight per byte (element 8i + j in bit j): `[..., N]` -> `[..., N/8]`."""
    _check_last_axis(bits, 8, "pack_bits")
    b = (bits.astype(jnp.uint8) & 1).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
    return jnp.sum(b * jnp.asarray(_BIT_WEIGHTS, jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_bits`: uint8 `[..., M]` -> uint8 0/1 `[..., 8 * M]`."""
    p = packed.astype(jnp.uint8)
    shifts = jnp.arange(8, dtype=jnp.uint8)
    bits = (p[..., None] >> shifts) & 1
    return bits.reshape(*p.shape[:-1], 8 * p.shape[-1])
