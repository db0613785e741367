"""`QTensor`: a block-quantized array (codes + block scales + optional global scale)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax.fp4.formats import BlockFormat


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A tensor quantized in blocks of `fmt.block_size` along its last axis.

    Invariants (checked by `validate`):
      codes: uint8 `[..., N]`, one code per element: E2M1 `sign << 3 | idx` (0..15) or the E4M3
        bit pattern; zero is always code 0. N is a multiple of `fmt.block_size`.
      scales: `[..., N // block_size]` in `fmt.scale_dtype` (float8_e8m0fnu or float8_e4m3fn).
        NaN marks a block whose input held NaN or Inf (its dequantized values are all NaN).
      global_scale: float32 (NVFP4 only, else None), broadcastable to `codes` with size 1 on the
        last axis; by default one value per row (`[..., 1]`).
      fmt: the static format (not a pytree leaf).
    """

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None
    fmt: BlockFormat = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def validate(self) -> QTensor:
        """Raises ValueError if the arrays break the invariants above; returns self."""
        validate_layout(
            self.shape,
            self.fmt,
            self.scales,
            self.global_scale,
            what="QTensor",
        )
        if self.codes.dtype != jnp.uint8:
            raise ValueError(f"QTensor.codes must be uint8, got {self.codes.dtype}")
        return self


def empty_scales(shape: tuple[int, ...], fmt: BlockFormat) -> jax.Array:
    """Block scales with all bits zero (E8M0: 2**-127, E4M3: 0): finite placeholders.

    `jnp.zeros(shape, float8_e8m0fnu)` is NaN (0xFF): E8M0 has no zero, and 0.0 converts to NaN.
    """
    return jax.lax.bitcast_convert_type(jnp.zeros(shape, jnp.uint8), fmt.scale_dtype)


def blocks_shape(shape: tuple[int, ...], fmt: BlockFormat) -> tuple[int, ...]:
    """Shape of the block-scale array for a tensor of `shape`; errors on a ragged last axis."""
    if len(shape) == 0:
        raise ValueError(f"{fmt.name}: cannot quantize a scalar; blocks run along the last axis")
    if shape[-1] % fmt.block_size:
        raise ValueError(
            f"{fmt.name}: the last axis ({shape[-1]}) must be a multiple of the block size "
            f"{fmt.block_size}; got shape {tuple(shape)}"
        )
    return (*shape[:-1], shape[-1] // fmt.block_size)


def validate_layout(shape, fmt: BlockFormat, scales, global_scale, *, what: str) -> None:
    """Checks block scales and global scale against a tensor of `shape` in `fmt`."""
    expected = blocks_shape(tuple(shape), fmt)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"{what}: scales of shape {tuple(scales.shape)} do not match a {fmt.name} tensor of "
            f"shape {tuple(shape)} (expected {expected})"
        )
    if jnp.dtype(scales.dtype) != fmt.scale_dtype:
        raise ValueError(f"{what}: scales must be {fmt.scale_dtype}, got {scales.dtype}")
    if fmt.has_global_scale:
        if global_scale is None:
            raise ValueError(f"{what}: {fmt.name} needs a float32 global_scale, got None")
        gs = tuple(global_scale.shape)
        if (
            len(gs) != len(shape)
            or gs[-1] != 1
            or any(g not in (1, s) for g, s in zip(gs, shape, strict=True))
        ):
            raise ValueError(
                f"{what}: global_scale of shape {gs} is not broadcastable to {tuple(shape)} with "
                "size 1 on the last axis"
            )
    elif global_scale is not None:
        raise ValueError(f"{what}: {fmt.name} has no global scale, but one was given")
