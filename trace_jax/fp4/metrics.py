"""Code-level comparisons between two quantizations of the same tensor (train vs rollout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.fp4.formats import BlockFormat


def signed_position(codes: jax.Array, fmt: BlockFormat) -> jax.Array:
    """Position of each code on the signed grid (int32): ..., -1 for -min, 0 for zero, +1, ...

    Adjacent grid points (also across zero) are one position apart.
    """
    spec = fmt.elem
    c = codes.astype(jnp.int32)
    idx = c & ((1 << spec.sign_shift) - 1)
    return jnp.where((c >> spec.sign_shift) & 1 == 1, -idx, idx)


def mismatch_stats(
    codes: jax.Array, reference_codes: jax.Array, fmt: BlockFormat, where: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Code mismatch between two code arrays of one shape.

    Args:
      codes, reference_codes: uint8 `[..., N]` (e.g. trainer and rollout codes).
      fmt: their format.
      where: optional bool mask broadcastable to the codes; only these elements count.

    Returns:
      float32 scalars: `mismatch` (fraction of elements whose codes differ), `one_apart_fraction`
      (of the mismatches, the fraction exactly one adjacent grid point apart; NaN if none), and
      int32 counts `n_elements`, `n_mismatch`, `n_one_apart`.
    """
    w = jnp.ones(codes.shape, bool) if where is None else jnp.broadcast_to(where, codes.shape)
    dist = jnp.abs(signed_position(codes, fmt) - signed_position(reference_codes, fmt))
    n = jnp.sum(w, dtype=jnp.int32)
    n_mis = jnp.sum(w & (dist > 0), dtype=jnp.int32)
    n_one = jnp.sum(w & (dist == 1), dtype=jnp.int32)
    return {
        "mismatch": n_mis / jnp.maximum(n, 1),
        "one_apart_fraction": jnp.where(n_mis > 0, n_one / jnp.maximum(n_mis, 1), jnp.nan),
        "n_elements": n,
        "n_mismatch": n_mis,
        "n_one_apart": n_one,
    }
