"""Fused FP4 quantize + compact-guidance capture (reference, Pallas kernels: Triton `kernel.py`,
Mosaic `mosaic.py`; the dispatching API)."""

from kernels_pallas.fp4_quantize.api import (
    QuantizedCapture,
    fp4_quantize,
    fp4_quantize_with_implementation,
)
from kernels_pallas.fp4_quantize.reference import quantize_capture_reference

__all__ = [
    "QuantizedCapture",
    "fp4_quantize",
    "fp4_quantize_with_implementation",
    "quantize_capture_reference",
]
