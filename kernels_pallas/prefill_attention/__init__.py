"""Flash attention of a prefill chunk over the KV cache (causal by cache slot, GQA).

    out = prefill_attention(q, k, v, positions, kv_lengths)   # q [B, T, Hkv, G, Dh] -> same shape

Files: `reference.py` (checks, the float32 XLA reference), `kernel.py` (Pallas, Triton lowering;
its docstring has the design), `api.py` (the op's interface: implementation choice with fallback).

Status: tested in interpret mode against the reference and in the Triton lowering; not yet run on a
GPU, so nothing about its speed is measured. No Mosaic (TPU) kernel: there the reference runs.
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
