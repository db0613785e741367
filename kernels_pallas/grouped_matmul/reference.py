"""The op's argument checks and its XLA reference, `jax.lax.ragged_dot` at HIGHEST precision.

Axis legend: M rows of lhs (sorted by group), K contraction, N outputs, G groups (experts).
Contract: `jax.lax.ragged_dot(lhs [M, K], rhs^T [G, K, N], group_sizes [G])` with the weights
stored `[G, N, K]`, contraction last: the model's expert weights are `w_gate`, `w_up [E, F, D]`
and `w_down [E, D, F]`, so each projection reads its weights as stored, and rows of both operands
are contiguous along K (wide vector loads for both; Hopper's tensor cores take a K-major B). Rows
are grouped contiguously by expert; rows past `sum(group_sizes)` give 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def check_operands(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array):
    """Validates shapes and dtypes; returns `(M, K, N, G)`.

    Raises ValueError naming the bad operand: ranks other than `[M, K]`, `[G, N, K]`, `[G]`; a K
    mismatch; dtypes other than bfloat16 / float16 / float32 or differing between lhs and rhs;
    group_sizes not int32.
    """
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be [G, N, K], got shape {rhs.shape}")
    if lhs.dtype not in FLOAT_DTYPES:
        raise ValueError(f"lhs must be bfloat16, float16 or float32, got {lhs.dtype}")
    if rhs.dtype != lhs.dtype:
        raise ValueError(f"rhs dtype {rhs.dtype} must equal lhs dtype {lhs.dtype}")
    m, k = lhs.shape
    g, n, k_rhs = rhs.shape
    if k != k_rhs:
        raise ValueError(
            f"contraction mismatch: lhs [M, K] = {tuple(lhs.shape)} but rhs [G, N, K] = "
            f"{tuple(rhs.shape)}"
        )
    if group_sizes.shape != (g,):
        raise ValueError(
            f"group_sizes must have shape (G,) = ({g},) to match rhs, got {group_sizes.shape}"
        )
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32, got {group_sizes.dtype}")
    return m, k, n, g


def grouped_matmul_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`ragged_dot(lhs, rhs^T, group_sizes)` with float32 accumulation at HIGHEST precision ->
    `[M, N]` in `out_dtype` (default lhs.dtype).

    On a GPU, XLA lowers it as a dense product over all G groups (G times the work): a
    reference, not a fast path."""
    check_operands(lhs, rhs, group_sizes)
    out = jax.lax.ragged_dot(
        lhs,
        jnp.swapaxes(rhs, -1, -2),
        group_sizes,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype or lhs.dtype)
