"""Plain-jnp references of single-token decode attention over a packed FP4 or a bf16 KV cache.

float32 throughout with `Precision.HIGHEST`; the FP4 cache is dequantized by `trace_jax.fp4` (the
one quantizer), so the reference and the rollout agree on every cached value by construction.

Axis legend: B batch, H query heads, Hkv kv heads, G = H // Hkv query heads per kv head (query
head h reads kv head h // G), S cache slots, Dh head dim.

Slots `< lengths[b]` are attended; every other slot holds stale data and is masked, its V row
zeroed too (a stale NaN must not leak through a zero probability). `lengths[b] == 0` gives NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.fp4 import PackedTensorCache

_HIGHEST = jax.lax.Precision.HIGHEST


def decode_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array
) -> jax.Array:
    """Softmax attention of one query token per sequence over a K/V cache of any float dtype.

    Args:
      q: [B, H, Dh] query of the new token.
      k, v: [B, S, Hkv, Dh] cached keys and values.
      lengths: int [B], number of valid slots of each sequence.

    Returns:
      [B, H, Dh] in q.dtype; computed in float32, scores scaled by Dh**-0.5.
    """
    b, h, dh = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, hkv, h // hkv, dh)
    valid = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k.astype(jnp.float32), precision=_HIGHEST)
    scores = jnp.where(valid[:, None, None, :], scores * dh**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    v32 = jnp.where(valid[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v32, precision=_HIGHEST)
    return out.reshape(b, h, dh).astype(q.dtype)


def fp4_decode_attention_reference(
    q: jax.Array, k_cache: PackedTensorCache, v_cache: PackedTensorCache, lengths: jax.Array
) -> jax.Array:
    """`decode_attention_reference` over the float32 dequantization of a packed FP4 cache."""
    return decode_attention_reference(
        q, k_cache.read(jnp.float32), v_cache.read(jnp.float32), lengths
    )


def bf16_decode_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array
) -> jax.Array:
    """The bf16 cache's reference: the same float32 computation on the bf16 K/V values."""
    return decode_attention_reference(q, k, v, lengths)
