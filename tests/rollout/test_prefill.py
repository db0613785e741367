"""Chunked prompt prefill against the one-piece model prefill: cache, records and logits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import tiny
from trace_jax.models import init_cache, init_model, prefill
from trace_jax.quant import QuantConfig, QuantSites, SiteMode
from trace_jax.rollout import ChunkGrid, SamplingConfig, chunk_grid, prefill_in_chunks

CFG32 = tiny.model_config(dtype=jnp.float32, init_std=0.08)
QCFG = QuantConfig.nvfp4()
KEYS = QCFG.all_keys(CFG32.n_layers)
LENGTHS = jnp.array([7, 3, 5, 1, 6], jnp.int32)  # B = 5 right-padded prompts, P = 7
B, P, EXTRA = 5, 7, 3  # cache slots P + EXTRA
# One worker runs the module: its tests share the one-piece prefill and the compiled chunks.
pytestmark = pytest.mark.xdist_group("prefill")


@pytest.fixture(autouse=True)
def highest_matmul_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    return init_model(CFG32, seed=1)


@pytest.fixture(scope="module")
def prompts():
    tokens = jax.random.randint(jax.random.key(0), (B, P), 1, CFG32.vocab_size, jnp.int32)
    return jnp.where(jnp.arange(P)[None] < LENGTHS[:, None], tokens, 0)


def _sites():
    return QuantSites(QCFG, CFG32.n_layers, SiteMode.RTN, capture=KEYS, differentiable=False)


def _empty_cache():
    return init_cache(CFG32, batch=B, max_len=P + EXTRA, kv_format="nvfp4")


@pytest.fixture(scope="module")
def one_piece(model, prompts):
    """The model's own prefill of all B x P tokens at once: last-position logits, cache, expert
    choices [L, B, P, K] and full guidance [B, P, ...]."""

    @jax.jit
    def run(prompts):
        sites = _sites()
        logits, aux, cache = prefill(model, _empty_cache(), prompts, LENGTHS, site=sites)
        last = jnp.take_along_axis(logits, (LENGTHS - 1)[:, None, None], axis=1)[:, 0]
        return last, cache, aux["topk_idx"], sites.captured_guidance("full")

    return run(prompts)


@functools.partial(jax.jit, static_argnames=("model", "chunk_tokens"))
def _chunked(model, prompts, chunk_tokens):
    def records(aux, sites):
        return jnp.moveaxis(aux["topk_idx"], 0, 2), sites.captured_guidance("full")

    def buffers(like):  # [B, P + EXTRA, ...] zeros
        return jax.tree.map(lambda a: jnp.zeros((B, P + EXTRA, *a.shape[2:]), a.dtype), like)

    return prefill_in_chunks(
        model,
        _empty_cache(),
        prompts,
        LENGTHS,
        chunk_tokens=chunk_tokens,
        new_site=_sites,
        records=records,
        record_buffers=buffers,
    )


def test_chunk_grid():
    assert chunk_grid(5, 7, 1000) == ChunkGrid(rows=5, positions=7, row_blocks=1, position_blocks=1)
    assert chunk_grid(5, 7, 14) == ChunkGrid(rows=2, positions=7, row_blocks=3, position_blocks=1)
    assert chunk_grid(5, 7, 13) == ChunkGrid(rows=1, positions=7, row_blocks=5, position_blocks=1)
    assert chunk_grid(5, 7, 4) == ChunkGrid(rows=1, positions=4, row_blocks=5, position_blocks=2)
    # A chunk keeps 2 positions (a one-token chunk would take the decode attention path).
    assert chunk_grid(5, 7, 1) == ChunkGrid(rows=1, positions=2, row_blocks=5, position_blocks=4)
    assert chunk_grid(3, 1, 1) == ChunkGrid(rows=1, positions=1, row_blocks=3, position_blocks=1)
    assert chunk_grid(64, 8192, 8192).n_chunks == 64
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1"):
            chunk_grid(5, 7, bad)
        with pytest.raises(ValueError, match="prefill_chunk_tokens must be an int >= 1"):
            SamplingConfig(max_new_tokens=1, prefill_chunk_tokens=bad)
    with pytest.raises(ValueError, match="prompt_len must be >= 1"):
        chunk_grid(5, 0, 8)


# Whole prompts, 2 rows per chunk (the last block overlaps: 2 does not divide 5) and 1 row.
@pytest.mark.parametrize("chunk_tokens", [14, 7])
def test_row_chunks_equal_the_one_piece_prefill(model, prompts, one_piece, chunk_tokens):
    """Chunks of whole prompts give the one-piece prefill's bits: next-token logits, every byte
    of the packed FP4 cache (stale slots included), expert choices and guidance at every prompt
    slot (padding included); buffer slots past the prompt stay as given. Each query attends the
    same keys over the same slots and the rows are the attention products' batch axis; the other
    products do not depend on their row count here (measured on the CPU)."""
    logits, cache, (experts, guidance) = _chunked(model, prompts, chunk_tokens)
    ref_logits, ref_cache, ref_experts, ref_guidance = one_piece
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(LENGTHS))
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.moveaxis(np.asarray(experts), 2, 0)[:, :, :P], ref_experts)
    assert set(guidance) == set(KEYS)
    for k in KEYS:
        pairs = zip(jax.tree.leaves(guidance[k]), jax.tree.leaves(ref_guidance[k]), strict=True)
        for got, want in pairs:
            got = np.asarray(got)
            np.testing.assert_array_equal(got[:, :P], np.asarray(want), err_msg=k)
            assert (got[:, P:] == 0).all(), k
    assert (np.asarray(experts)[:, P:] == 0).all()


def test_position_chunks_match_the_one_piece_prefill(model, prompts, one_piece):
    """Chunks of positions: every query sees the one-piece prefill's keys, but the attention
    products hold fewer queries and may sum in another order, so results agree to float32
    rounding: the same expert choices, FP4 codes and block scales except where a value sits at a
    rounding boundary (none measured; at most 1% allowed), global scales and logits within a few
    ulps. A query that saw other keys, a wrong RoPE position or another row's cache would move
    logits by ~1e-2 and most codes from its layer on."""
    grid = chunk_grid(B, P, 4)  # 4 positions: 4 does not divide 7, the last chunk overlaps
    assert (grid.rows, grid.positions, grid.position_blocks) == (1, 4, 2)
    logits, cache, (experts, guidance) = _chunked(model, prompts, 4)
    ref_logits, ref_cache, ref_experts, ref_guidance = one_piece
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(experts), 2, 0)[:, :, :P], ref_experts)

    def assert_close(got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        if got.dtype == jnp.float32:  # NVFP4 global scales
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=what)
        else:  # packed codes, E4M3 block scales
            assert np.mean(got != want) <= 0.01, (what, np.mean(got != want))

    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache), strict=True):
        assert_close(got, want, "cache")
    for k in KEYS:
        pairs = zip(jax.tree.leaves(guidance[k]), jax.tree.leaves(ref_guidance[k]), strict=True)
        for got, want in pairs:
            assert_close(np.asarray(got)[:, :P], want, k)
    # Sites ahead of the first attention ("0/k", "0/v") see identical inputs: identical codes.
    for k in ("0/k", "0/v"):
        got, want = guidance[k].rollout_codes()[:, :P], ref_guidance[k].rollout_codes()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_prefill_in_chunks_errors(model, prompts):
    cache = _empty_cache()
    with pytest.raises(ValueError, match=r"prompt lengths must be \[B\]"):
        prefill_in_chunks(model, cache, prompts, LENGTHS[:2], chunk_tokens=8)
    small = init_cache(CFG32, batch=B, max_len=P - 1)
    with pytest.raises(ValueError, match="max_len 6 cannot hold prompts"):
        prefill_in_chunks(model, small, prompts, LENGTHS, chunk_tokens=8)
    with pytest.raises(ValueError, match="chunk_tokens"):
        prefill_in_chunks(model, cache, prompts, LENGTHS, chunk_tokens=0)


@pytest.mark.usefixtures("pallas_interpreted_on_cpu")
def test_cudnn_prefill_serves_chunks_of_whole_prompts(model, prompts, one_piece, monkeypatch):
    """`prefill_attention="cudnn"`: chunks of whole prompts attend by cuDNN's fused attention
    (`jax.nn.dot_product_attention`, run here by its XLA implementation, counted) and give the
    one-piece prefill's next-token logits to float32 rounding; chunks of positions go to the
    flash kernel (counted when traced), since cuDNN's causal mask would start them at the wrong
    slot. Whole prompts attended without the causal mask, or over other slots, move the logits by
    ~1e-2."""
    from kernels_pallas.prefill_attention import kernel

    cudnn_model = init_model(dataclasses.replace(CFG32, prefill_attention="cudnn"), seed=1)
    if jax.default_backend() != "gpu":  # no cuDNN: a clear error, not a silent fallback
        with pytest.raises(RuntimeError, match="prefill_attention='cudnn' needs cuDNN"):
            _chunked(cudnn_model, prompts, 14)
    cudnn_calls, kernel_calls = [], []
    library = jax.nn.dot_product_attention

    def fused(*args, implementation=None, **kwargs):
        cudnn_calls.append(implementation)
        return library(*args, implementation="xla", **kwargs)

    def flash(*args, **kwargs):
        kernel_calls.append(1)
        return traced(*args, **kwargs)

    traced = kernel.prefill_attention_pallas
    monkeypatch.setattr(jax.nn, "dot_product_attention", fused)
    monkeypatch.setattr(kernel, "prefill_attention_pallas", flash)
    # Each layer is traced twice (the chunk's shapes, then the scan's body).
    logits = _chunked(cudnn_model, prompts, 14)[0]
    assert (cudnn_calls, kernel_calls) == (["cudnn"] * 2 * CFG32.n_layers, [])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(one_piece[0]), rtol=0, atol=1e-5)
    # Chunks of positions: which attention serves them is decided when tracing (the kernel's
    # results are `tests/models/test_cache.py`'s).
    cudnn_calls.clear()
    jax.eval_shape(functools.partial(_chunked, cudnn_model, chunk_tokens=4), prompts)
    assert (cudnn_calls, kernel_calls) == ([], [1] * 2 * CFG32.n_layers)
