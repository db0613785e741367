"""Grouped (ragged) MoE matmul with packed FP4 weights and FP4/FP8 block-scaled or bf16 activations.

Contract: `jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`, with the
weights stored `[G, N, K]` (contraction last, like the model's `[E, F, D]` expert weights):

    rhs = pack_weights(w, fp4.NVFP4)            # w [G, N, K] float -> PackedFP4Weights
    lhs = fp4.quantize(x_sorted, fp4.MXFP8)      # or MXFP4 / NVFP4 QTensor, or bfloat16 [M, K]
    y = fp4_moe_matmul(lhs, rhs, group_sizes)    # [M, N] bfloat16, float32 accumulation

Files: `reference.py` (types, checks, float32 XLA reference), `kernel.py` (Pallas, Triton
lowering; its docstring has the design and the numerics), `predecoded.py` (prefill: the weights
decoded in one pass before a bf16 grouped matmul), `mosaic.py` (Pallas, Mosaic lowering for
TPUs), `api.py` (the op's interface: implementation and lowering choice with fallback).

Status: the Triton kernel runs on the H200 (experiments/results/kernels_moe_matmul.md); both
kernels run interpreted in CI (the Mosaic one has not run on a TPU). The "scaled_matmul"
implementation (`scaled.py`: `jax.nn.scaled_matmul` over per-group row tiles, for native
block-scaled FP4 on Blackwell) is tested on the CPU against the reference; it was never run on a
Blackwell GPU (none available), so nothing about its speed is measured.
"""

from kernels_pallas.fp4_moe_matmul.api import (
    MoEImplementation,
    block_config,
    fp4_moe_matmul,
    fp4_moe_matmul_with_implementation,
    implementation_order,
    predecode_pays,
)
from kernels_pallas.fp4_moe_matmul.kernel import (
    BlockConfig,
    default_block_config,
    fp4_moe_matmul_pallas,
    tile_group_ranges,
)
from kernels_pallas.fp4_moe_matmul.reference import (
    PackedFP4Weights,
    check_operands,
    dequantize_lhs,
    dequantize_weights,
    fp4_moe_matmul_reference,
    pack_weights,
)

__all__ = [
    "BlockConfig",
    "MoEImplementation",
    "PackedFP4Weights",
    "block_config",
    "check_operands",
    "default_block_config",
    "dequantize_lhs",
    "dequantize_weights",
    "fp4_moe_matmul",
    "fp4_moe_matmul_pallas",
    "fp4_moe_matmul_reference",
    "fp4_moe_matmul_with_implementation",
    "implementation_order",
    "pack_weights",
    "predecode_pays",
    "tile_group_ranges",
]
