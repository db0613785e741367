"""Grouped (ragged) matmul of bf16 operands that does not densify over experts.

Contract: `jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`, with the
weights stored `[G, N, K]` (contraction last, like the model's `[E, F, D]` expert weights):

    y = grouped_matmul(x_sorted, w, group_sizes)   # [M, N], float32 accumulation

Files: `reference.py` (checks, the `ragged_dot` reference), `kernel.py` (Pallas, Triton lowering,
on a group-major grid that the FP4 MoE kernel shares; its docstring has the design), `api.py` (the
op's interface: implementation choice with fallback; on a TPU the Pallas kernel is jax's megablox
`gmm`, `grouped_matmul_megablox`). Gradients: `trace_jax.models.grouped_matmul`
pairs the kernel's forward with the tiled XLA form's VJP.
"""

from kernels_pallas.grouped_matmul.api import (
    block_config,
    grouped_matmul,
    grouped_matmul_megablox,
    grouped_matmul_with_implementation,
    megablox_tiling,
)
from kernels_pallas.grouped_matmul.kernel import (
    BlockConfig,
    default_block_config,
    group_row_bounds,
    grouped_matmul_pallas,
)
from kernels_pallas.grouped_matmul.reference import check_operands, grouped_matmul_reference

__all__ = [
    "BlockConfig",
    "block_config",
    "check_operands",
    "default_block_config",
    "group_row_bounds",
    "grouped_matmul",
    "grouped_matmul_megablox",
    "grouped_matmul_pallas",
    "grouped_matmul_reference",
    "grouped_matmul_with_implementation",
    "megablox_tiling",
]
