"""Pallas flash attention of a prefill chunk over the KV cache (Triton lowering on a GPU).

Why. The model's XLA attention (`trace_jax.models.attention.attend`) writes float32 scores for a
block of queries against every cache slot, then reads them back for the mask, the softmax and the
value product. At the Qwen3-30B-A3B shapes (32 query heads, 8K-token prompts) that is about 35 GB
of score traffic per sequence and layer, about 10 of the 12.2 s that a batch-64 x 8K bf16 prefill
takes on the H200 (experiments/results/rollout_throughput.md; the estimate is in docs/kernels.md).
Flash attention keeps the scores in registers: the chunk's queries stream over K/V blocks with an
online softmax, and causal masking ends each query tile's loop at its last visible slot.

Semantics (`reference.prefill_attention_reference`): query t of row b sees cache slot s iff
`s <= positions[b, t]` and `s < kv_lengths[b]` (`forward_cached`'s mask: a chunk of prompt
positions, written to the cache before it attends); scale Dh**-0.5, float32 scores and softmax.

Structure. The G query heads of a kv head share its K/V: the queries enter as `[B, Hkv, T * G,
Dh]` rows (position-major, head-minor; one XLA transpose before the call), with each row's
position. Grid (B, Hkv, R / block_r): program (b, h, i) holds rows `[i * block_r, (i + 1) *
block_r)` and loops over K/V blocks of `block_s` slots from slot 0 to its last visible one,
`min(kv_lengths[b], max position in the tile + 1)` (`common.online_softmax_step`: running max and
sum, float32 accumulator), masking per row and slot; K/V loads are masked at `kv_lengths[b]`, so
stale slots and the cache's end are never read. The probabilities are cast to the value dtype
for the p . v dot (the reference casts the normalized ones: the two differ by that rounding).
Every row sees slot 0 (positions >= 0), so the first block gives every row a finite maximum.

Hopper: `default_block_config` is Triton's flash-attention forward configuration for head_dim
128 (128 x 64 tiles, 8 warps, 3 stages), not yet swept on the H200.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import common

MIN_BLOCK = 16  # Triton's smallest dot tile edge
_PRECISION = jax.lax.Precision.HIGHEST  # float32 operands: IEEE dots, not TF32


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Tiles and Triton launch parameters: `block_r` query rows (positions x heads of one kv head)
    and `block_s` cache slots per step, powers of two >= 16."""

    block_r: int = 128
    block_s: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_r", "block_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < MIN_BLOCK or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {value!r}")
        if not isinstance(self.num_warps, int) or self.num_warps < 1:
            raise ValueError(f"num_warps must be an int >= 1, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")


def default_block_config(rows: int, slots: int) -> BlockConfig:
    """128 x 64 tiles (Triton's flash-attention forward for head_dim 128), smaller where the
    chunk's `rows` (T x G) or the cache's `slots` are fewer."""
    fit = lambda n, cap: max(MIN_BLOCK, min(cap, pl.next_power_of_2(n)))
    return BlockConfig(block_r=fit(rows, 128), block_s=fit(slots, 64))


def _kernel(len_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, *, block_s: int, scale: float):
    """Program (b, h, i): the rows of `pos_ref` [block_r] and `q_ref` [block_r, Dh] over the
    slots of `k_ref`, `v_ref` [S, Dh]."""
    kv_len = len_ref[()]
    pos = pos_ref[...]  # [block_r] int32
    q = q_ref[...]  # [block_r, Dh]
    visible = jnp.minimum(kv_len, jnp.max(pos) + 1)  # slots [0, visible) hold every key seen
    n_blocks = (visible + block_s - 1) // block_s

    def body(j, carry):
        m, total, acc = carry
        start = j * block_s
        slots = start + jnp.arange(block_s, dtype=jnp.int32)
        in_cache = slots < kv_len
        k = common.load_rows(k_ref, start, block_s, in_cache)  # [block_s, Dh]
        v = common.load_rows(v_ref, start, block_s, in_cache)
        s = jnp.dot(q, k.T, precision=_PRECISION, preferred_element_type=jnp.float32) * scale
        seen = (slots[None, :] <= pos[:, None]) & in_cache[None, :]
        s = jnp.where(seen, s, -jnp.inf)
        m, alpha, p, total = common.online_softmax_step(m, total, s)
        pv = jnp.dot(p.astype(v.dtype), v, precision=_PRECISION, preferred_element_type=jnp.float32)
        return m, total, alpha[:, None] * acc + pv

    rows, dh = q.shape
    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, dh), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    total = jnp.where(total > 0, total, 1.0)  # a row of an empty cache (kv_lengths 0) gives 0
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def prefill_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    kv_lengths: jax.Array,
    *,
    config: BlockConfig,
    interpret: bool = False,
) -> jax.Array:
    """Flash attention of `q [B, T, Hkv, G, Dh]` over `k, v [B, S, Hkv, Dh]` (q's dtype, bfloat16
    or float32) at query `positions [B, T]` int32 with `kv_lengths [B]` int32 valid slots;
    returns [B, T, Hkv, G, Dh] in q's dtype. The api checks the operands."""
    b, t, hkv, g, dh = q.shape
    s = k.shape[1]
    rows = t * g
    padded = pl.cdiv(rows, config.block_r) * config.block_r
    pad = ((0, 0), (0, 0), (0, padded - rows))
    q_rows = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, hkv, rows, dh)  # row = t * G + g
    q_rows = jnp.pad(q_rows, (*pad, (0, 0)))
    row_pos = jnp.pad(jnp.repeat(positions, g, axis=1), pad[1:])  # padding rows: position 0
    sq = pl.squeezed
    out = pl.pallas_call(
        functools.partial(_kernel, block_s=config.block_s, scale=dh**-0.5),
        grid=(b, hkv, padded // config.block_r),
        in_specs=[
            pl.BlockSpec((sq,), lambda i, j, r: (i,)),
            pl.BlockSpec((sq, config.block_r), lambda i, j, r: (i, r)),
            pl.BlockSpec((sq, sq, config.block_r, dh), lambda i, j, r: (i, j, r, 0)),
            pl.BlockSpec((sq, s, sq, dh), lambda i, j, r: (i, 0, j, 0)),
            pl.BlockSpec((sq, s, sq, dh), lambda i, j, r: (i, 0, j, 0)),
        ],
        out_specs=pl.BlockSpec((sq, sq, config.block_r, dh), lambda i, j, r: (i, j, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, padded, dh), q.dtype),
        compiler_params=common.triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="prefill_attention",
    )(jnp.minimum(kv_lengths, s), row_pos, q_rows, k, v)
    out = out[:, :, :rows].reshape(b, hkv, t, g, dh)
    return jnp.transpose(out, (0, 2, 1, 3, 4))
