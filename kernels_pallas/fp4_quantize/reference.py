"""Plain-jnp reference of fused quantize + capture: `trace_jax.fp4` calls, nothing else."""

from __future__ import annotations

import dataclasses

import jax

from trace_jax import fp4
from trace_jax.fp4 import BlockFormat, Guidance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedCapture:
    """What one fused pass emits for `x [..., N]`.

    packed_codes: uint8 [..., N // 2] (element 2i in the low nibble).
    scales: [..., N // block] in the format's scale dtype.
    global_scale: float32 [..., 1] (NVFP4) or None.
    compact_bits: uint8 [..., N // 8], the mantissa LSBs (compact guidance payload).
    """

    packed_codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None
    compact_bits: jax.Array
    fmt: BlockFormat = dataclasses.field(metadata=dict(static=True))

    def qtensor(self) -> fp4.QTensor:
        return fp4.QTensor(
            fp4.unpack_fp4(self.packed_codes), self.scales, self.global_scale, self.fmt
        )

    def compact_guidance(self) -> Guidance:
        return self.guidance(fp4.GuidanceMode.COMPACT)

    def guidance(self, mode: str | fp4.GuidanceMode = "compact") -> Guidance:
        """The capture as guidance, straight from the pass's outputs (no second pass over codes):
        compact = the mantissa-LSB bits, full = the packed codes (`fp4.make_guidance`'s payloads).
        """
        mode = fp4.GuidanceMode(mode)
        payload = self.compact_bits if mode is fp4.GuidanceMode.COMPACT else self.packed_codes
        return Guidance(payload, self.scales, self.global_scale, None, self.fmt, mode)


def quantize_capture_reference(
    x: jax.Array, fmt: BlockFormat, *, guidance: Guidance | None = None
) -> QuantizedCapture:
    """RTN (or guided, with `guidance`) quantization of `x [..., N]`, per-row NVFP4 global scale."""
    rounding = "rtn" if guidance is None else "guided"
    q = fp4.quantize(x, fmt, rounding=rounding, guidance=guidance)
    return QuantizedCapture(
        packed_codes=fp4.pack_fp4(q.codes),
        scales=q.scales,
        global_scale=q.global_scale,
        compact_bits=fp4.pack_bits(q.codes & 1),
        fmt=fmt,
    )
