"""Flash-decoding attention over a packed FP4 KV cache (and its bf16 twin): reference, Pallas
kernels (Triton `kernel.py`, with the design and byte counts; Mosaic `mosaic.py`, FP4 only), and
the api that picks the implementation and lowering."""

from kernels_pallas.fp4_decode_attention.api import (
    DEFAULT_BLOCK_S,
    FP4_DEFAULT_BLOCK_S,
    FP4_LONG_CONTEXT_NUM_STAGES,
    FP4_LONG_CONTEXT_SLOTS,
    FP4_PV_TRANSPOSED_MIN_HEAD_DIM,
    FP4_TARGET_PROGRAMS,
    DecodePlan,
    bf16_decode_attention,
    bf16_decode_attention_plan,
    default_k_splits,
    fp4_decode_attention,
    fp4_decode_attention_plan,
)
from kernels_pallas.fp4_decode_attention.kernel import BlockConfig
from kernels_pallas.fp4_decode_attention.reference import (
    bf16_decode_attention_reference,
    decode_attention_reference,
    fp4_decode_attention_reference,
)

__all__ = [
    "DEFAULT_BLOCK_S",
    "FP4_DEFAULT_BLOCK_S",
    "FP4_LONG_CONTEXT_NUM_STAGES",
    "FP4_LONG_CONTEXT_SLOTS",
    "FP4_PV_TRANSPOSED_MIN_HEAD_DIM",
    "FP4_TARGET_PROGRAMS",
    "BlockConfig",
    "DecodePlan",
    "bf16_decode_attention",
    "bf16_decode_attention_plan",
    "bf16_decode_attention_reference",
    "decode_attention_reference",
    "default_k_splits",
    "fp4_decode_attention",
    "fp4_decode_attention_plan",
    "fp4_decode_attention_reference",
]
