"""Prompt prefill in chunks: peak memory set by a token budget, tokens computed as in one piece.

A prefill of all B x P prompt tokens at once holds every per-token temporary of a layer for all
of them: at the Qwen3-30B-A3B shapes cut to 12 layers, batch 64 x 8K prompts, XLA's CPU compile
of the bf16 rollout asks for 1311 GiB of temporaries (expert matmul buffers, 100 GiB a layer, and
logits and attention scores of every prompt token). Here the prompts run as a grid of chunks of
`rows` sequences x `positions` prompt positions (`chunk_grid`, at most `chunk_tokens` tokens
each), one after the other in a `jax.lax.scan`: one compiled chunk however many there are, and
per-chunk temporaries about `chunk_tokens / (B * P)` of the whole prefill's (27 GiB there at the
default 8192 tokens; the attention bounds its scores itself, `trace_jax.models.attention`).
Only each row's last prompt position goes through the LM head.

Each token is computed as in the one-piece prefill: a chunk runs `forward_cached` at its
positions against the cache whose lengths are already the prompt lengths, so each query attends
exactly the keys the one-piece prefill gives it (slots `s <= t` and `s < prompt length`, written
by this or an earlier chunk of its rows: the chunks of a row block run in position order), over
the same S slots; everything else is per token (norms, projections, routing, the experts, the FP4
sites, whose blocks and NVFP4 global scales run along the feature axis). The last block of each
axis starts at `P - positions` (`B - rows`) and recomputes a few tokens instead of padding.
Bits: chunks of whole prompts (the grid's choice while a prompt fits the budget) give the
one-piece bits on the CPU, since rows are the attention products' batch axis; chunks of positions
give attention products fewer queries, which XLA may sum in another order (float32 rounding,
tested). A GPU's matmul kernels may pick their summation order by shape in either case.

Axis legend: B batch, P prompt slots, S cache slots, D model, V vocab, L layers, K top-k.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from trace_jax.models import KVCache, QuantSite, Qwen3MoE, forward_cached, identity_site


@dataclasses.dataclass(frozen=True)
class ChunkGrid:
    """How a `[B, P]` prompt batch is cut: chunks of `rows` x `positions` tokens,
    `row_blocks` x `position_blocks` of them, position blocks innermost."""

    rows: int
    positions: int
    row_blocks: int
    position_blocks: int

    @property
    def n_chunks(self) -> int:
        return self.row_blocks * self.position_blocks


def chunk_grid(batch: int, prompt_len: int, chunk_tokens: int) -> ChunkGrid:
    """The chunks of a `[batch, prompt_len]` prefill within `chunk_tokens` tokens each.

    Whole prompts first (`rows = chunk_tokens // prompt_len` sequences per chunk: each row's keys
    are then read once), and one sequence cut into `chunk_tokens` positions when a prompt alone
    is longer. A chunk has at least 2 positions (unless P is 1): a one-token chunk would take the
    decode-attention path of a packed FP4 cache, not the prefill's attention.
    """
    for name, value in (("batch", batch), ("prompt_len", prompt_len)):
        if value < 1:
            raise ValueError(f"chunk_grid: {name} must be >= 1, got {value}")
    integral = isinstance(chunk_tokens, numbers.Integral) and not isinstance(chunk_tokens, bool)
    if not integral or chunk_tokens < 1:
        raise ValueError(f"prefill chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    chunk_tokens = int(chunk_tokens)
    if chunk_tokens >= prompt_len:
        rows, positions = min(batch, chunk_tokens // prompt_len), prompt_len
    else:
        rows, positions = 1, min(prompt_len, max(chunk_tokens, 2))
    return ChunkGrid(rows, positions, -(-batch // rows), -(-prompt_len // positions))


def _rows(a: jax.Array, start: jax.Array, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)


def _set_rows(a: jax.Array, part: jax.Array, start: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(a, part.astype(a.dtype), start, axis=0)


def prefill_in_chunks(
    model: Qwen3MoE,
    cache: KVCache,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    *,
    chunk_tokens: int,
    new_site: Callable[[], QuantSite] = lambda: identity_site,
    records: Callable[[dict[str, jax.Array], QuantSite], Any] = lambda aux, site: (),
    record_buffers: Callable[[Any], Any] = lambda like: (),
) -> tuple[jax.Array, KVCache, Any]:
    """Prefills right-padded `prompts [B, P]` (row b's first `prompt_lengths[b]` tokens real)
    into an empty `cache` (max_len >= P), in chunks of at most `chunk_tokens` tokens.

    Args:
      model: the decoder.
      cache: an empty cache of B sequences; its `lengths` are replaced by `prompt_lengths`.
      prompts: int32 [B, P]; prompt_lengths: int32 [B] in [1, P].
      chunk_tokens: token budget of one chunk (`chunk_grid`).
      new_site: a fresh quantization site for each chunk's forward call (a `QuantSites` collects
        the captures of one call).
      records: `(aux, site) -> pytree of [rows, positions, ...]` arrays to keep per token (e.g.
        expert choices, captured guidance), batch and position on the first two axes.
      record_buffers: `like -> pytree of [B, S, ...]` buffers (S >= P) that take the records at
        slots `[0, P)`; `like` is the pytree of `jax.ShapeDtypeStruct` one chunk's records have.

    Returns:
      (next-token logits [B, V] float32 at position `prompt_lengths[b] - 1`, the cache with
      `lengths = prompt_lengths`, the record buffers).
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [B, P], got shape {prompts.shape}")
    b, p = prompts.shape
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if prompt_lengths.shape != (b,):
        raise ValueError(f"prompt lengths must be [B]=({b},), got shape {prompt_lengths.shape}")
    if cache.batch != b or cache.max_len < p:
        raise ValueError(
            f"a cache of batch {cache.batch} and max_len {cache.max_len} cannot hold prompts "
            f"[B, P] = {(b, p)}"
        )
    grid = chunk_grid(b, p, chunk_tokens)
    cache = KVCache(layers=cache.layers, lengths=prompt_lengths)
    slot = jnp.arange(grid.positions, dtype=jnp.int32)[None, :]
    whole_prompts = grid.position_blocks == 1  # every chunk starts at slot 0 (`chunk_inputs`)

    def run_chunk(cache_rows: KVCache, tokens: jax.Array, t0: jax.Array):
        site = new_site()
        positions = jnp.broadcast_to(t0 + slot, tokens.shape)
        hidden, aux, cache_rows = forward_cached(
            model, cache_rows, tokens, positions, site=site, from_start=whole_prompts
        )
        return hidden, records(aux, site), cache_rows

    def chunk_inputs(i):
        # The last block of each axis is moved back to end at B (P): it recomputes a few tokens.
        r0 = jnp.minimum((i // grid.position_blocks) * grid.rows, b - grid.rows)
        t0 = jnp.minimum((i % grid.position_blocks) * grid.positions, p - grid.positions)
        tokens = jax.lax.dynamic_slice(prompts, (r0, t0), (grid.rows, grid.positions))
        return r0, t0, tokens

    r0, t0, tokens = chunk_inputs(jnp.int32(0))
    cache_rows = jax.tree.map(lambda a: _rows(a, r0, grid.rows), cache)
    hidden_like, records_like, _ = jax.eval_shape(run_chunk, cache_rows, tokens, t0)
    buffers = record_buffers(records_like)
    last_hidden = jnp.zeros((b, hidden_like.shape[-1]), hidden_like.dtype)

    def body(carry, i):
        cache, last_hidden, buffers = carry
        r0, t0, tokens = chunk_inputs(i)
        cache_rows = jax.tree.map(lambda a: _rows(a, r0, grid.rows), cache)
        hidden, recs, cache_rows = run_chunk(cache_rows, tokens, t0)
        cache = jax.tree.map(lambda a, part: _set_rows(a, part, r0), cache, cache_rows)
        # Row b's next-token hidden state sits at position prompt_lengths[b] - 1.
        at = _rows(prompt_lengths, r0, grid.rows) - 1 - t0
        here = (at >= 0) & (at < grid.positions)
        h = jnp.take_along_axis(hidden, jnp.clip(at, 0, grid.positions - 1)[:, None, None], 1)
        last = jnp.where(here[:, None], h[:, 0], _rows(last_hidden, r0, grid.rows))
        last_hidden = _set_rows(last_hidden, last, r0)

        def put(buf, rec):
            start = (r0, t0) + (0,) * (rec.ndim - 2)
            return jax.lax.dynamic_update_slice(buf, rec.astype(buf.dtype), start)

        buffers = jax.tree.map(put, buffers, recs)
        return (cache, last_hidden, buffers), None

    carry = (cache, last_hidden, buffers)
    chunks = jnp.arange(grid.n_chunks, dtype=jnp.int32)
    (cache, last_hidden, buffers), _ = jax.lax.scan(body, carry, chunks)
    logits = model.logits(last_hidden[:, None])[:, 0]
    return logits, cache, buffers
