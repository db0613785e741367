"""RMSNorm, RoPE, the explicit KV cache and Qwen3 grouped-query attention.

Axis legend (shapes in docstrings; einsum letters in parentheses): B batch (b), T query time (t),
S key slot (s), D model (d), H query heads (h), Hkv key/value heads (n), G = H / Hkv query heads per
kv head (g), Dh head dim (c).

KV cache convention (right padding, slot == position): sequence b holds its tokens in cache slots
`0 .. lengths[b] - 1`, the token at slot s having RoPE position s. New tokens are appended at slot
`lengths[b]` onwards; slots at or beyond `lengths[b]` hold stale values and are always masked. A
padded prompt batch is therefore given right-padded, with a per-sequence count of real tokens.

A packed FP4 cache (`PackedLayerKVCache` of two `trace_jax.fp4.PackedTensorCache`) is written
through the fused quantize op, and with the site's implementation "pallas" a decode step attends
with the FP4 decode-attention op, which reads the packed bytes directly (`kernels_pallas`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.common import Implementation
from kernels_pallas.fp4_decode_attention import fp4_decode_attention
from kernels_pallas.fp4_quantize import fp4_quantize
from kernels_pallas.prefill_attention import prefill_attention
from trace_jax import fp4
from trace_jax.fp4 import BlockFormat, PackedTensorCache
from trace_jax.fp4.packed_cache import write_slots
from trace_jax.models.backends import kernel_order, prefill_attention_order, site_implementation
from trace_jax.models.config import ModelConfig, QuantSite, SiteName

_MASKED = float(jnp.finfo(jnp.float32).min)

# Attention over a cache runs its queries in blocks of at most this many: the float32 scores of
# one block, [B, H, block, S], instead of [B, H, T, S] (a prefill of 8K-token prompts would hold
# 8K x 8K scores per head and sequence, 8.6 GB per Qwen3-30B-A3B sequence).
QUERY_BLOCK = 1024


class RMSNorm(nnx.Module):
    """`y = x / sqrt(mean(x^2) + eps) * scale` over the last axis, in float32, output in `dtype`."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, Dh/2] (float32) of the RoPE angles `pos * theta^(-2i/Dh)`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x [B, T, N, Dh]` by the angles [B, T, Dh/2] (half-split layout, as Hugging Face)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------------ KV cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKVCache:
    """One layer's cache: k, v [B, S, Hkv, Dh] in the compute dtype."""

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayerKVCache:
    """One layer's FP4 cache, the packed twin of `LayerKVCache`: k, v [B, S, Hkv, Dh] stored as
    packed codes plus block scales."""

    k: PackedTensorCache
    v: PackedTensorCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer caches plus `lengths [B] int32`, the number of valid slots of each sequence.

    Invariant: slots `< lengths[b]` of sequence b hold the keys/values of positions
    `0 .. lengths[b] - 1`; every other slot is masked. `lengths <= max_len` is the caller's
    responsibility (writes past `max_len` are dropped).
    """

    layers: tuple[LayerKVCache | PackedLayerKVCache, ...]
    lengths: jax.Array

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[1]


def init_cache(
    cfg: ModelConfig,
    *,
    batch: int,
    max_len: int,
    kv_format: str | BlockFormat | None = None,
) -> KVCache:
    """An empty cache of `max_len` slots for `batch` sequences (lengths 0).

    kv_format: None for a cache in the compute dtype, or an FP4 format ("nvfp4", "mxfp4") for a
    packed FP4 cache (`PackedLayerKVCache`: codes two per byte plus block scales).
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache needs batch > 0 and max_len > 0, got {batch}, {max_len}")
    shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    if kv_format is not None:
        fmt = fp4.get_format(kv_format)
        layers = tuple(
            PackedLayerKVCache(
                k=PackedTensorCache.empty(shape, fmt),
                v=PackedTensorCache.empty(shape, fmt),
            )
            for _ in range(cfg.n_layers)
        )
    else:
        layers = tuple(
            LayerKVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype))
            for _ in range(cfg.n_layers)
        )
    return KVCache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32))


def cache_write(
    cache: LayerKVCache | PackedLayerKVCache,
    k: jax.Array,
    v: jax.Array,
    slots: jax.Array,
    *,
    implementation: Implementation = Implementation.XLA,
) -> LayerKVCache | PackedLayerKVCache:
    """Write k, v [B, T, Hkv, Dh] at `slots [B, T]` (int32); out-of-range slots are dropped.

    A packed FP4 cache stores the round-to-nearest codes of k, v, quantized here by the fused
    quantize op (`implementation`, see `kernel_order`; every implementation gives the same codes).
    """
    if isinstance(cache, PackedLayerKVCache):
        order = kernel_order(implementation)

        def quantize(x, fmt):
            return fp4_quantize(x, fmt, implementation=order).qtensor()

        return PackedLayerKVCache(
            k=cache.k.write(quantize(k, cache.k.fmt), slots),
            v=cache.v.write(quantize(v, cache.v.fmt), slots),
        )
    return LayerKVCache(k=write_slots(cache.k, k, slots), v=write_slots(cache.v, v, slots))


def cache_read(cache: LayerKVCache | PackedLayerKVCache, dtype=None) -> tuple[jax.Array, jax.Array]:
    """All slots of k, v [B, S, Hkv, Dh] (a packed cache is dequantized to `dtype`)."""
    if isinstance(cache, PackedLayerKVCache):
        return cache.k.read(dtype), cache.v.read(dtype)
    return cache.k, cache.v


def causal_mask(valid: jax.Array) -> jax.Array:
    """Mask [B, T, T] for a full sequence: key slot s <= query slot t and key `valid [B, T]`."""
    t = valid.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return causal[None] & valid[:, None, :]


def cache_mask(q_positions: jax.Array, kv_lengths: jax.Array, max_len: int) -> jax.Array:
    """Mask [B, T, S] over cache slots: slot s <= query position and s < `kv_lengths [B]`."""
    s = jnp.arange(max_len)
    return (s[None, None, :] <= q_positions[:, :, None]) & (
        s[None, None, :] < kv_lengths[:, None, None]
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheMask:
    """`cache_mask` kept as its parts, for attention over a cache: query positions int32
    [B, T] (= their slots), valid slots int32 [B], the cache's slots S (static). A flash kernel
    takes the parts; `dense()` is the [B, T, S] bool mask. `from_start` (static) promises that
    the positions are 0 .. T-1 in every row (a chunk of whole prompts into an empty cache): the
    mask is then causal over the first T slots for every query before `lengths`, all that
    cuDNN's fused attention can express."""

    positions: jax.Array
    lengths: jax.Array
    max_len: int = dataclasses.field(metadata=dict(static=True))
    from_start: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def dense(self) -> jax.Array:
        return cache_mask(self.positions, self.lengths, self.max_len)


# What `Attention` takes: a dense bool mask [B, T, S], or a cache's mask by its parts.
AttentionMask = jax.Array | CacheMask


# ----------------------------------------------------------------------------------- attention


def causal_prefix_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "cudnn"
) -> jax.Array:
    """Causal attention of `q [B, T, Hkv, G, Dh]` at positions 0 .. T-1 over the first T slots of
    `k, v [B, S >= T, Hkv, Dh]` by `jax.nn.dot_product_attention` (cuDNN's fused attention by
    default; "xla" is its reference). Returns [B, T, Hkv, G, Dh] in q's dtype.

    Equal to `attend` under `CacheMask(positions 0 .. T-1, lengths)` for every query before
    `lengths[b]`; a padding query (at or after it) also sees the padding slots before it, which
    only padding reads (its outputs are junk either way)."""
    b, t, hkv, g, dh = q.shape
    try:
        out = jax.nn.dot_product_attention(
            q.reshape(b, t, hkv * g, dh),
            k[:, :t],
            v[:, :t],
            is_causal=True,
            implementation=implementation,
        )
    except RuntimeError as e:  # jax's "cuDNN is not detected" and its kin say too little
        raise RuntimeError(
            f"prefill_attention='cudnn' needs cuDNN's fused attention (an NVIDIA GPU): {e}"
        ) from e
    return out.reshape(q.shape)


def _attend_block(q, k, v, mask, scale):
    scores = jnp.einsum("btngc,bsnc->bngts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # [B, Hkv, G, T, S]
    return jnp.einsum("bngts,bsnc->btngc", probs, v)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    query_block: int | None = None,
) -> jax.Array:
    """Softmax attention of `q [B, T, Hkv, G, Dh]` over `k, v [B, S, Hkv, Dh]` (all in the
    compute dtype) where `mask [B, T, S]` is set; returns [B, T, Hkv, G, Dh] in q's dtype.

    Scores and softmax are float32, the probabilities are cast to q's dtype for the value product.
    query_block: None computes all T queries at once; an int runs blocks of that many queries one
    after another (`jax.lax.map`, the last block padded with fully masked queries), so only one
    block's scores exist at a time. A query's result does not depend on its block in exact
    arithmetic; the kernels may sum in another order for another number of queries.
    """
    b, t = q.shape[:2]
    scale = q.shape[-1] ** -0.5
    if query_block is None or t <= query_block:
        return _attend_block(q, k, v, mask, scale)
    n_blocks = -(-t // query_block)
    pad = n_blocks * query_block - t
    q = jnp.pad(q, [(0, 0), (0, pad)] + [(0, 0)] * (q.ndim - 2))
    mask = jnp.pad(mask, [(0, 0), (0, pad), (0, 0)])

    def blocks(a):  # [B, n_blocks * block, ...] -> [n_blocks, B, block, ...]
        return jnp.swapaxes(a.reshape(b, n_blocks, query_block, *a.shape[2:]), 0, 1)

    def one_block(qm):
        return _attend_block(qm[0], k, v, qm[1], scale)

    out = jax.lax.map(one_block, (blocks(q), blocks(mask)))  # [n_blocks, B, block, ...]
    return jnp.swapaxes(out, 0, 1).reshape(b, n_blocks * query_block, *out.shape[3:])[:, :t]


class Attention(nnx.Module):
    """Qwen3 grouped-query attention: q/k projections, per-head RMSNorm, RoPE, softmax, output.

    Weights: w_q [D, H, Dh], w_k and w_v [D, Hkv, Dh], w_o [H, Dh, D]; q_norm, k_norm over Dh.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        d, h, n, c = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.w_q = nnx.Param(init(rngs.params(), (d, h, c), cfg.param_dtype))
        self.w_k = nnx.Param(init(rngs.params(), (d, n, c), cfg.param_dtype))
        self.w_v = nnx.Param(init(rngs.params(), (d, n, c), cfg.param_dtype))
        self.w_o = nnx.Param(init(rngs.params(), (h, c, d), cfg.param_dtype))
        norm = dict(eps=cfg.rms_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.q_norm = RMSNorm(c, **norm)
        self.k_norm = RMSNorm(c, **norm)
        self.cfg = cfg

    def __call__(
        self,
        x: jax.Array,
        *,
        positions: jax.Array,
        mask: AttentionMask,
        layer: int,
        site: QuantSite,
        cache: LayerKVCache | None = None,
        slots: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerKVCache | None]:
        """Attend `x [B, T, D]` at RoPE `positions [B, T]`; returns y [B, T, D] and the cache.

        Without a cache, keys are the T new tokens and `mask` is [B, T, T]. With a cache, the new
        k, v are written at `slots [B, T]` first, attention reads all S slots, `mask` is
        [B, T, S] or a `CacheMask` (then several new tokens, a prefill chunk, attend as
        `cfg.prefill_attention` says). The sites "k" and "v" see k, v [B, T, Hkv, Dh] before
        any cache write.
        """
        cfg = self.cfg
        dt = cfg.dtype
        x = x.astype(dt)
        q = jnp.einsum("btd,dhc->bthc", x, self.w_q[...].astype(dt))
        k = jnp.einsum("btd,dnc->btnc", x, self.w_k[...].astype(dt))
        v = jnp.einsum("btd,dnc->btnc", x, self.w_v[...].astype(dt))
        cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        k_raw, v_raw = k, v
        k = site(k, name=SiteName.K, layer=layer)
        v = site(v, name=SiteName.V, layer=layer)
        if cache is not None:
            if slots is None:
                raise ValueError("Attention with a cache needs `slots` [B, T]")
            implementation = site_implementation(site)
            if isinstance(cache, PackedLayerKVCache):
                # The packed cache quantizes the raw k, v (RTN): the computation of an FP4
                # rollout's "k"/"v" sites, so it stores exactly their codes (re-quantizing their
                # dequantized NVFP4 values would not reproduce them).
                cache = cache_write(cache, k_raw, v_raw, slots, implementation=implementation)
            else:
                cache = cache_write(cache, k, v, slots)
            if (
                isinstance(cache, PackedLayerKVCache)
                and implementation is Implementation.PALLAS
                and q.shape[1] == 1
            ):
                # One new token: the FP4 decode-attention kernel reads the packed cache directly.
                out = fp4_decode_attention(
                    q[:, 0],
                    cache.k,
                    cache.v,
                    slots[:, 0] + 1,
                    implementation=kernel_order(implementation),
                )
                y = jnp.einsum("bhc,hcd->bd", out.astype(dt), self.w_o[...].astype(dt))
                return y[:, None], cache
            k, v = cache_read(cache, dt)
        b, t = q.shape[:2]
        q = q.reshape(b, t, cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim)  # [B, T, Hkv, G, Dh]
        # Only a prefill chunk asks for its kernel (a "pallas" setting raises where none runs).
        chunk = isinstance(mask, CacheMask) and t > 1 and cfg.prefill_attention != "xla"
        order = prefill_attention_order(cfg.prefill_attention) if chunk else ()
        if chunk and cfg.prefill_attention == "cudnn" and mask.from_start:
            out = causal_prefix_attention(q, k.astype(dt), v.astype(dt))
        elif order and order[0] is Implementation.PALLAS:
            out = prefill_attention(
                q, k.astype(dt), v.astype(dt), mask.positions, mask.lengths, implementation=order
            )
        else:
            dense = mask.dense() if isinstance(mask, CacheMask) else mask
            # Blocks of queries bound a prefill's scores; the trainer's forward (no cache) keeps
            # one block, since differentiating it saves every block's probabilities anyway.
            query_block = None if cache is None else QUERY_BLOCK
            out = attend(q, k.astype(dt), v.astype(dt), dense, query_block=query_block)
        out = out.reshape(b, t, cfg.n_heads, cfg.head_dim)
        y = jnp.einsum("bthc,hcd->btd", out, self.w_o[...].astype(dt))
        return y, cache
