"""The XLA reference of `prefill_attention`: dense scores, float32 softmax (the semantics of
`trace_jax.models.attention.attend` under `cache_mask`, written here without importing models)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = float(jnp.finfo(jnp.float32).min)


def check_operands(q, k, v, positions, kv_lengths) -> tuple[int, int, int, int, int, int]:
    """Validates shapes and dtypes; returns (B, T, Hkv, G, Dh, S). ValueError on a mismatch."""
    if q.ndim != 5:
        raise ValueError(f"q must be [B, T, Hkv, G, Dh], got shape {q.shape}")
    b, t, hkv, g, dh = q.shape
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 4 or (a.shape[0], a.shape[2], a.shape[3]) != (b, hkv, dh):
            raise ValueError(
                f"{name} must be [B, S, Hkv, Dh] = [{b}, S, {hkv}, {dh}], got {a.shape}"
            )
        if a.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    if positions.shape != (b, t) or positions.dtype != jnp.int32:
        raise ValueError(f"positions must be int32 [B, T] = [{b}, {t}], got {positions.dtype} "
                         f"{positions.shape}")  # fmt: skip
    if kv_lengths.shape != (b,) or kv_lengths.dtype != jnp.int32:
        raise ValueError(f"kv_lengths must be int32 [B] = [{b}], got {kv_lengths.dtype} "
                         f"{kv_lengths.shape}")  # fmt: skip
    return b, t, hkv, g, dh, k.shape[1]


def prefill_mask(positions: jax.Array, kv_lengths: jax.Array, slots: int) -> jax.Array:
    """bool [B, T, S]: query t of row b sees slot s iff `s <= positions[b, t]` and
    `s < kv_lengths[b]`."""
    s = jnp.arange(slots, dtype=jnp.int32)
    return (s[None, None, :] <= positions[:, :, None]) & (
        s[None, None, :] < kv_lengths[:, None, None]
    )


def prefill_attention_reference(q, k, v, positions, kv_lengths) -> jax.Array:
    """Softmax attention of `q [B, T, Hkv, G, Dh]` over `k, v [B, S, Hkv, Dh]` under
    `prefill_mask`; scores and softmax in float32, the probabilities cast to q's dtype for the
    value product. Returns [B, T, Hkv, G, Dh] in q's dtype."""
    mask = prefill_mask(positions, kv_lengths, k.shape[1])
    scale = q.shape[-1] ** -0.5
    precision = jax.lax.Precision.HIGHEST
    scores = jnp.einsum(
        "btngc,bsnc->bngts", q, k, preferred_element_type=jnp.float32, precision=precision
    )
    scores = jnp.where(mask[:, None, None], scores * scale, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bngts,bsnc->btngc", probs, v, precision=precision)
