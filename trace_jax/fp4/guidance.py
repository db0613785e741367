"""Rollout guidance: what the rollout's real quantizer chose, in full or compact form (SPEC 4, 5).

Full guidance keeps every rollout code (FP4 codes packed two per byte; FP8 codes one per byte) and
the block scales. Compact guidance keeps one mantissa bit per element (packed eight per byte) and
the block scales: the trainer's own value already narrows the choice to two adjacent grid points,
which always differ in that bit.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from trace_jax.fp4.formats import BlockFormat
from trace_jax.fp4.packing import pack_bits, pack_fp4, unpack_bits, unpack_fp4
from trace_jax.fp4.qtensor import QTensor, validate_layout


class GuidanceMode(enum.StrEnum):
    FULL = "full"
    COMPACT = "compact"


def _elements_per_byte(fmt: BlockFormat, mode: GuidanceMode) -> int:
    if mode is GuidanceMode.COMPACT:
        return 8
    return 2 if fmt.is_fp4 else 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Guidance:
    """The rollout's rounding decisions for one quantized tensor `[..., N]`.

    Attributes:
      payload: uint8. Full: the codes, `[..., N // 2]` packed (FP4) or `[..., N]` (FP8).
        Compact: mantissa LSBs `[..., N // 8]`, element 8i + j in bit j.
      scales: the rollout's block scales `[..., N // block_size]` in `fmt.scale_dtype`.
      global_scale: the rollout's float32 global scale (NVFP4), else None.
      mask: bool `[...]`, rows that carry guidance (None: all). Rows without guidance are
        quantized with the trainer's own scales and round-to-nearest.
      fmt, mode: static.
    """

    payload: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None
    mask: jax.Array | None
    fmt: BlockFormat = dataclasses.field(metadata=dict(static=True))
    mode: GuidanceMode = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the guided tensor."""
        n = self.payload.shape[-1] * _elements_per_byte(self.fmt, self.mode)
        return (*self.payload.shape[:-1], n)

    @property
    def nbytes(self) -> int:
        """Bytes of payload, scales and global scale (what a store would hold)."""
        leaves = [self.payload, self.scales, self.global_scale]
        return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in leaves if x is not None)

    def rollout_codes(self) -> jax.Array:
        """The rollout's codes `[..., N]` uint8 (full guidance only)."""
        if self.mode is not GuidanceMode.FULL:
            raise ValueError("rollout_codes() needs full guidance; compact keeps only one bit")
        return unpack_fp4(self.payload) if self.fmt.is_fp4 else self.payload

    def mantissa_bits(self) -> jax.Array:
        """The rollout's mantissa LSB per element, uint8 0/1 `[..., N]` (either mode)."""
        if self.mode is GuidanceMode.COMPACT:
            return unpack_bits(self.payload)
        return self.rollout_codes() & 1

    def as_compact(self) -> Guidance:
        """The same rounding decisions as compact guidance (full keeps more than compact needs:
        its codes' mantissa bits, packed, are the compact payload; scales are shared)."""
        if self.mode is GuidanceMode.COMPACT:
            return self
        bits = pack_bits(self.mantissa_bits())
        return Guidance(
            bits, self.scales, self.global_scale, self.mask, self.fmt, GuidanceMode.COMPACT
        )

    def check_matches(self, shape: tuple[int, ...], fmt: BlockFormat) -> None:
        """Raises ValueError unless this guidance can guide a `fmt` tensor of `shape`."""
        if self.fmt != fmt:
            raise ValueError(
                f"guidance is {self.fmt.name} but the tensor is quantized as {fmt.name}"
            )
        if self.payload.dtype != jnp.uint8:
            raise ValueError(f"guidance payload must be uint8, got {self.payload.dtype}")
        if tuple(self.shape) != tuple(shape):
            raise ValueError(
                f"{self.mode.value} guidance for shape {self.shape} cannot guide a tensor of shape "
                f"{tuple(shape)}"
            )
        validate_layout(shape, fmt, self.scales, self.global_scale, what="guidance")
        if self.mask is not None and tuple(self.mask.shape) != tuple(shape[:-1]):
            raise ValueError(
                f"guidance mask of shape {tuple(self.mask.shape)} must be the tensor's leading "
                f"shape {tuple(shape[:-1])}"
            )


def make_guidance(
    q: QTensor, mode: str | GuidanceMode = "compact", mask: jax.Array | None = None
) -> Guidance:
    """Guidance from the rollout's quantized tensor `q` (codes, scales and global scale).

    Args:
      q: the rollout's `QTensor` `[..., N]`.
      mode: "compact" (1 bit per element + scales) or "full" (codes + scales).
      mask: optional bool `[...]` of rows that carry guidance.
    """
    mode = GuidanceMode(mode)
    if mode is GuidanceMode.FULL:
        payload = pack_fp4(q.codes) if q.fmt.is_fp4 else q.codes
    else:
        payload = pack_bits(q.codes & 1)
    g = Guidance(payload, q.scales, q.global_scale, mask, q.fmt, mode)
    if mask is not None:
        g.check_matches(q.shape, q.fmt)
    return g


def guidance_bits_per_element(
    fmt: BlockFormat, mode: str | GuidanceMode, row_length: int | None = None
) -> float:
    """Storage bits per guided element: payload + block scale (+ NVFP4 global scale per row).

    MXFP4: full 4.25, compact 1.25. NVFP4: full 4.5, compact 1.5 (+ 32 / row_length).
    """
    mode = GuidanceMode(mode)
    bits = fmt.element_bits if mode is GuidanceMode.FULL else 1
    bits += 8 / fmt.block_size
    if fmt.has_global_scale and row_length is not None:
        bits += 32 / row_length
    return float(bits)


def to_compact(g: Guidance) -> Guidance:
    """Compact guidance (mantissa bits + scales) from full guidance; compact passes through."""
    if g.mode is GuidanceMode.COMPACT:
        return g
    return Guidance(
        pack_bits(g.mantissa_bits()), g.scales, g.global_scale, g.mask, g.fmt, GuidanceMode.COMPACT
    )
