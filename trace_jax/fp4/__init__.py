"""FP4 numerics core: block formats, the quantizer, guided rounding, compact guidance and the
packed FP4 KV cache storage.

Public names here are a contract used by the model, rollout, trainer, kernels and tests.
"""

from trace_jax.fp4.fake_quant import fake_quant
from trace_jax.fp4.formats import (
    FORMATS,
    MXFP4,
    MXFP8,
    NVFP4,
    BlockFormat,
    ElementType,
    ScaleType,
    get_format,
    register_format,
)
from trace_jax.fp4.guidance import (
    Guidance,
    GuidanceMode,
    guidance_bits_per_element,
    make_guidance,
    to_compact,
)
from trace_jax.fp4.metrics import mismatch_stats, signed_position
from trace_jax.fp4.packed_cache import PackedTensorCache
from trace_jax.fp4.packing import pack_bits, pack_fp4, unpack_bits, unpack_fp4
from trace_jax.fp4.qtensor import QTensor, empty_scales
from trace_jax.fp4.quantize import Rounding, dequantize, quantize
from trace_jax.fp4.scales import scales_to_float32

__all__ = [
    "FORMATS",
    "MXFP4",
    "MXFP8",
    "NVFP4",
    "BlockFormat",
    "ElementType",
    "Guidance",
    "GuidanceMode",
    "PackedTensorCache",
    "QTensor",
    "Rounding",
    "ScaleType",
    "dequantize",
    "empty_scales",
    "fake_quant",
    "get_format",
    "guidance_bits_per_element",
    "make_guidance",
    "mismatch_stats",
    "pack_bits",
    "pack_fp4",
    "quantize",
    "register_format",
    "scales_to_float32",
    "signed_position",
    "to_compact",
    "unpack_bits",
    "unpack_fp4",
]
