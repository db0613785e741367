"""Mosaic (TPU) flash attention of a prefill chunk over the KV cache.

The contract of `kernel.prefill_attention_pallas` (`reference.prefill_attention_reference`):
q [B, T, Hkv, G, Dh] bf16 or float32, k, v [B, S, Hkv, Dh], positions int32 [B, T], kv_lengths
int32 [B]; query t of row b sees slot s iff `s <= positions[b, t]` and `s < kv_lengths[b]`.

Structure. As in the Triton kernel the G query heads of a kv head share its K/V: the queries are
`[B, Hkv, R = T x G, Dh]` rows with each row's position (one XLA transpose before the call).
Grid (B, Hkv, R / block_r, S / block_s): the K/V blocks are BlockSpec-pipelined over the last,
"arbitrary" axis (the next block's DMA overlaps this block's compute) and an online softmax
(running max, sum, float32 accumulator) carries across it in VMEM scratch; the last step writes
the normalized tile. Causal skipping: each row tile's last visible slot, `min(kv_lengths[b], max
position of the tile + 1)`, arrives by scalar prefetch (SMEM, computed in XLA); the K/V index
map clamps the block index to that slot's block, so later steps repeat it (the pipeline skips
the copy) and `pl.when` skips their compute. Inside a block, slots a row does not see get score
-inf, and V rows at or past kv_lengths[b] (stale slots, or the unspecified padding of an edge
block when S is not a multiple of block_s) are zeroed by a select, so no stale NaN reaches the
output through a zero probability.

Tiles: rows are sublanes (block_r a multiple of 16: bf16's sublane tile), slots are the scores'
lanes (block_s a multiple of 128, or all of S), Dh the full last dim. Row positions enter as
[B, R, 1] so that a tile's are a [block_r, 1] column, the layout of the scores' rows.

What a first TPU run should check: that it compiles (Mosaic's layout passes run only in the TPU
compiler), then block_r / block_s (not tuned on a TPU), and against jax's own TPU flash attention
(`jax.experimental.pallas.ops.tpu.flash_attention`, whose causal mask assumes queries from
position 0 and equal heads, hence this kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
SUBLANES = 16  # bf16's sublane tile (float32's 8 divides it)
DEFAULT_BLOCK_R = 128
DEFAULT_BLOCK_S = 512


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """Rows per query tile (a multiple of SUBLANES) and slots per grid step (a multiple of LANES,
    or all of S)."""

    block_r: int
    block_s: int


def mosaic_tiling(rows: int, slots: int, block_r: int | None, block_s: int | None) -> MosaicTiling:
    """The tiling for `rows` (T x G) query rows over `slots` cache slots; ValueError for a
    block_r that is no positive multiple of SUBLANES or a block_s no positive multiple of
    LANES."""
    block_r = DEFAULT_BLOCK_R if block_r is None else block_r
    block_s = DEFAULT_BLOCK_S if block_s is None else block_s
    if not isinstance(block_r, int) or block_r < SUBLANES or block_r % SUBLANES:
        raise ValueError(f"block_r must be a positive multiple of {SUBLANES}, got {block_r!r}")
    if not isinstance(block_s, int) or block_s < LANES or block_s % LANES:
        raise ValueError(f"block_s must be a positive multiple of {LANES}, got {block_s!r}")
    block_r = min(block_r, pl.cdiv(rows, SUBLANES) * SUBLANES)
    return MosaicTiling(block_r, min(block_s, slots))  # one whole-S block: legal for any S


def _dot(a, b, dims):
    return jax.lax.dot_general(
        a, b, (dims, ((), ())), precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # fmt: skip


def _kernel(len_ref, end_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
            block_s: int, n_tiles: int, scale: float):  # fmt: skip
    """One (b, h, row tile, K/V step): folds a K/V block into the online softmax in VMEM."""
    b, step = pl.program_id(0), pl.program_id(3)
    kv_len = len_ref[b]
    visible = end_ref[b * n_tiles + pl.program_id(2)]
    start = step * block_s

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(start < visible)
    def _accumulate():
        slot_lanes = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        slot_rows = start + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
        q, k = q_ref[...], k_ref[...]
        s = _dot(q, k, ((1,), (1,))) * scale  # [block_r, block_s]
        seen = (slot_lanes <= pos_ref[...]) & (slot_lanes < kv_len)
        s = jnp.where(seen, s, -jnp.inf)
        m_prev = m_ref[...]  # [block_r, 1]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        m_ref[...] = m_new
        v = jnp.where(slot_rows < kv_len, v_ref[...], jnp.zeros((), v_ref.dtype))
        acc_ref[...] = alpha * acc_ref[...] + _dot(p.astype(v.dtype), v, ((1,), (0,)))

    @pl.when(step == pl.num_programs(3) - 1)
    def _write():
        total = l_ref[...]
        total = jnp.where(total > 0, total, 1.0)  # a row that sees no slot gives 0
        o_ref[...] = (acc_ref[...] / total).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def prefill_attention_mosaic(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    kv_lengths: jax.Array,
    *,
    tiling: MosaicTiling,
    interpret: pltpu.InterpretParams | None = None,
) -> jax.Array:
    """Flash attention of `q [B, T, Hkv, G, Dh]` over `k, v [B, S, Hkv, Dh]` on a TPU (the api
    checks the operands; `mosaic_tiling` gives `tiling`); `interpret=pltpu.InterpretParams()`
    runs it with TPU semantics on the CPU. Returns [B, T, Hkv, G, Dh] in q's dtype."""
    b, t, hkv, g, dh = q.shape
    s = k.shape[1]
    rows = t * g
    block_r, block_s = tiling.block_r, tiling.block_s
    n_tiles = pl.cdiv(rows, block_r)
    padded = n_tiles * block_r
    q_rows = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, hkv, rows, dh)  # row = t * G + g
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    row_pos = jnp.pad(jnp.repeat(positions, g, axis=1), ((0, 0), (0, padded - rows)))
    kv_lengths = jnp.clip(kv_lengths, 0, s)
    # Each row tile's last visible slot + 1 (its max position + 1, at most kv_lengths[b]).
    tile_end = jnp.minimum(
        row_pos.reshape(b, n_tiles, block_r).max(axis=2) + 1, kv_lengths[:, None]
    )
    k, v = (jnp.transpose(a, (0, 2, 1, 3)) for a in (k, v))  # head-major [B, Hkv, S, Dh]

    def kv_block(i, j, r, step, len_ref, end_ref):
        last = jnp.maximum(jax.lax.div(end_ref[i * n_tiles + r] + block_s - 1, block_s) - 1, 0)
        return jnp.minimum(step, last)

    sq = pl.squeezed
    kv_spec = pl.BlockSpec(
        (sq, sq, block_s, dh), lambda i, j, r, st, *refs: (i, j, kv_block(i, j, r, st, *refs), 0)
    )
    row_spec = pl.BlockSpec((sq, sq, block_r, dh), lambda i, j, r, st, *refs: (i, j, r, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, n_tiles=n_tiles, scale=dh**-0.5),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hkv, n_tiles, pl.cdiv(s, block_s)),
            in_specs=[
                pl.BlockSpec((sq, block_r, 1), lambda i, j, r, st, *refs: (i, r, 0)),
                row_spec,
                kv_spec,
                kv_spec,
            ],
            out_specs=row_spec,
            scratch_shapes=[
                pltpu.VMEM((block_r, 1), jnp.float32),
                pltpu.VMEM((block_r, 1), jnp.float32),
                pltpu.VMEM((block_r, dh), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, hkv, padded, dh), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=False if interpret is None else interpret,
        name="prefill_attention_mosaic",
    )(kv_lengths, tile_end.reshape(-1), row_pos[..., None], q_rows, k, v)
    out = out[:, :, :rows].reshape(b, hkv, t, g, dh)
    return jnp.transpose(out, (0, 2, 1, 3, 4))
