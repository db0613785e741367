"""Flash attention of a prefill chunk over the KV cache (causal by cache slot, GQA).

    out = prefill_attention(q, k, v, positions, kv_lengths)   # q [B, T, Hkv, G, Dh] -> same shape

Files: `reference.py` (checks, the float32 XLA reference), `kernel.py` (Pallas, Triton lowering;
its docstring has the design), `mosaic.py` (Pallas, Mosaic lowering for TPUs), `api.py` (the op's
interface: implementation and lowering choice with fallback).

Status: both kernels tested in interpret mode against a float64 reference and in their lowerings
(Triton for an H200, Mosaic for a TPU); neither has run on its hardware yet, so nothing about
their speed is measured.
"""

from kernels_pallas.prefill_attention.api import block_config, prefill_attention
from kernels_pallas.prefill_attention.kernel import (
    BlockConfig,
    default_block_config,
    prefill_attention_pallas,
)
from kernels_pallas.prefill_attention.reference import (
    prefill_attention_reference,
    prefill_mask,
)

__all__ = [
    "BlockConfig",
    "block_config",
    "default_block_config",
    "prefill_attention",
    "prefill_attention_pallas",
    "prefill_attention_reference",
    "prefill_mask",
]
