"""KV cache: prefill + token-by-token decode equal the teacher-forced forward (right padding)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from tests.models.rounding import assert_logits_agree, routing_decided
from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache
from trace_jax.models import (
    Qwen3MoE,
    cache_write,
    decode_step,
    decode_step_jit,
    forward_cached,
    forward_jit,
    init_cache,
    init_model,
    prefill,
    prefill_jit,
)
from trace_jax.models.attention import attend, cache_mask

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")

CFG32 = tiny.model_config(dtype=jnp.float32, init_std=0.1)
LENGTHS = np.array([7, 3, 5])  # prompt lengths, right-padded to 7
N_DECODE = 4
MAX_LEN = 16
SEQ_LEN = 11  # tokens of each row of `seqs`: every forward here attends over at most these


@pytest.fixture(autouse=True)
def highest_matmul_precision():
    """Exact float32 matmuls on every backend (GPUs default to TF32-like precision)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model() -> Qwen3MoE:
    return init_model(CFG32, seed=3)


@pytest.fixture(scope="module")
def seqs() -> jax.Array:
    """[3, SEQ_LEN] token ids; row b is prompt b followed by its N_DECODE continuation tokens.
    (A draw with no token near a routing tie: `routing_decided` holds with a wide margin.)"""
    return jax.random.randint(jax.random.key(16), (3, SEQ_LEN), 1, CFG32.vocab_size, jnp.int32)


def right_padded_prompts(seqs: jax.Array) -> jax.Array:
    t = int(LENGTHS.max())
    keep = np.arange(t)[None, :] < LENGTHS[:, None]
    return jnp.where(keep, seqs[:, :t], 0)


def reference(model, tokens: jax.Array, **kw):
    """The uncached forward the cached paths are checked against, jitted: eagerly every op of the
    model compiles on its own (several times one program's compile)."""
    return forward_jit(*nnx.split(model), tokens, **kw)


def continuation(seqs: jax.Array, step: int) -> jax.Array:
    return seqs[np.arange(len(LENGTHS)), LENGTHS + step]


def kv_site(x, *, name, layer, experts=None):
    return x * 1.3 + 0.05 * (layer + 1) if name in ("k", "v") else x


@pytest.mark.parametrize("site", [None, kv_site])
def test_prefill_decode_match_forward_with_padding(model, seqs, site):
    kw = {} if site is None else {"site": site}
    ref, ref_aux = reference(model, seqs, **kw)
    # The cached path and the forward sum in different orders; no token is near a routing tie, so
    # they route alike (exactly) and their logits differ by rounding only.
    assert routing_decided(model, ref_aux["router_probs"], SEQ_LEN).all()
    graphdef, params = nnx.split(model)
    cache = init_cache(CFG32, batch=3, max_len=MAX_LEN)
    logits, aux, cache = prefill_jit(
        graphdef, params, cache, right_padded_prompts(seqs), jnp.asarray(LENGTHS), **kw
    )
    np.testing.assert_array_equal(cache.lengths, LENGTHS)
    for b, n in enumerate(LENGTHS):
        assert_logits_agree(model, logits[b, :n], ref[b, :n], SEQ_LEN)
        np.testing.assert_array_equal(aux["topk_idx"][:, b, :n], ref_aux["topk_idx"][:, b, :n])
    for step in range(N_DECODE):
        logits, aux, cache = decode_step_jit(
            graphdef, params, cache, continuation(seqs, step), **kw
        )
        assert logits.shape == (3, CFG32.vocab_size) and aux["topk_idx"].shape[2] == 1
        for b, n in enumerate(LENGTHS):
            assert_logits_agree(model, logits[b], ref[b, n + step], SEQ_LEN)
            np.testing.assert_array_equal(
                aux["topk_idx"][:, b, 0], ref_aux["topk_idx"][:, b, n + step]
            )
    np.testing.assert_array_equal(cache.lengths, LENGTHS + N_DECODE)


def test_chunked_prefill_and_decode_sites(model, seqs):
    ref, ref_aux = reference(model, seqs[:1, :6])
    assert routing_decided(model, ref_aux["router_probs"], 6).all()
    graphdef, params = nnx.split(model)
    cache = init_cache(CFG32, batch=1, max_len=8)
    _, _, cache = prefill_jit(graphdef, params, cache, seqs[:1, :4], jnp.array([3]))  # 1 padded
    logits, _, cache = prefill_jit(graphdef, params, cache, seqs[:1, 3:5], jnp.array([2]))
    assert_logits_agree(model, logits[0], ref[0, 3:5], 6)
    calls = []

    def record(x, *, name, layer, experts=None):
        calls.append((str(name), layer, tuple(x.shape)))
        return x

    # The un-jitted entry point; the site records at trace time under decode_step_jit as well.
    logits, _, cache = decode_step(model, cache, seqs[:1, 5], site=record)
    assert_logits_agree(model, logits[0], ref[0, 5], 6)
    kv_shape = (1, 1, CFG32.n_kv_heads, CFG32.head_dim)
    assert ("k", 0, kv_shape) in calls and ("v", CFG32.n_layers - 1, kv_shape) in calls
    assert len(calls) == 7 * CFG32.n_layers
    assert int(cache.lengths[0]) == 6


def test_inactive_sequences_do_not_advance(model, seqs):
    graphdef, params = nnx.split(model)
    prompts = right_padded_prompts(seqs)
    outs = []
    # All active vs row 1 paused: the same compiled step, so rows 0 and 2 compute the same numbers.
    for active in (jnp.array([True, True, True]), jnp.array([True, False, True])):
        cache = init_cache(CFG32, batch=3, max_len=MAX_LEN)
        _, _, cache = prefill_jit(graphdef, params, cache, prompts, jnp.asarray(LENGTHS))
        logits, _, cache = decode_step_jit(
            graphdef, params, cache, continuation(seqs, 0), active=active
        )
        logits, _, cache = decode_step_jit(graphdef, params, cache, continuation(seqs, 1))
        outs.append((logits, cache.lengths))
    (full, _), (partial, partial_len) = outs
    np.testing.assert_array_equal(partial_len, LENGTHS + np.array([2, 1, 2]))
    np.testing.assert_array_equal(partial[0], full[0])
    np.testing.assert_array_equal(partial[2], full[2])


def test_bfloat16_cache_dtype_and_finite(seqs):
    cfg = tiny.model_config()
    model = init_model(cfg, seed=0)
    cache = init_cache(cfg, batch=3, max_len=MAX_LEN)
    assert cache.layers[0].k.dtype == jnp.bfloat16 and len(cache.layers) == cfg.n_layers
    graphdef, params = nnx.split(model)
    prompts = right_padded_prompts(seqs)
    logits, _, cache = prefill_jit(graphdef, params, cache, prompts, jnp.asarray(LENGTHS))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    assert cache.layers[-1].v.dtype == jnp.bfloat16


def test_cache_errors(model, seqs):
    with pytest.raises(ValueError, match="max_len"):
        init_cache(CFG32, batch=2, max_len=0)
    cache = init_cache(CFG32, batch=3, max_len=4)
    with pytest.raises(ValueError, match="max_len 4"):
        prefill(model, cache, seqs[:, :6], jnp.asarray(LENGTHS))
    with pytest.raises(ValueError, match="batch"):
        prefill(model, cache, seqs[:2, :3], jnp.array([3, 3]))
    with pytest.raises(ValueError, match=r"\[B\]"):
        decode_step(model, cache, seqs[:, :1])
    with pytest.raises(ValueError, match=r"positions must be \[B, T\]=\(3, 2\)"):
        forward_cached(model, cache, seqs[:, :2], jnp.zeros((3, 3), jnp.int32))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_packed_cache_write_stores_the_quantizers_codes(implementation):
    """A packed layer cache quantizes k, v through the fused quantize op (Pallas in interpret mode
    off the GPU) and stores exactly `fp4.quantize`'s RTN codes and scales, for either
    implementation."""
    cache = init_cache(CFG32, batch=2, max_len=4, kv_format="nvfp4").layers[0]
    k, v = 2.0 * jax.random.normal(jax.random.key(4), (2, 2, 2, CFG32.n_kv_heads, CFG32.head_dim))
    slots = jnp.array([[0, 1], [3, 2]], jnp.int32)
    out = cache_write(cache, k, v, slots, implementation=implementation)
    for got, x in ((out.k, k), (out.v, v)):
        want = PackedTensorCache.empty(got.shape, fp4.NVFP4).write(fp4.quantize(x, "nvfp4"), slots)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_attention_in_query_blocks_equals_one_block():
    """Queries in blocks of 3 (the last one padded) over a cache mask with padded rows: each
    query's output equals the all-at-once attention's to float32 rounding (they may sum in
    another order), so no block sees another block's mask rows or keys."""
    b, t, s, n, g, c = 2, 8, 11, 2, 2, 16
    q, k, v = (
        jax.random.normal(key, shape)
        for key, shape in zip(
            jax.random.split(jax.random.key(5), 3),
            [(b, t, n, g, c), (b, s, n, c), (b, s, n, c)],
            strict=True,
        )
    )
    positions = jnp.array([[0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8, 9, 10]])
    mask = cache_mask(positions, jnp.array([6, 11]), s)  # row 0: queries 6, 7 are padding
    whole = attend(q, k, v, mask)
    blocked = attend(q, k, v, mask, query_block=3)
    assert blocked.shape == whole.shape == (b, t, n, g, c)
    # Each output is a convex combination of values: within a few ulps of max |v|.
    np.testing.assert_allclose(blocked, whole, rtol=0, atol=8 * 2.0**-24 * float(jnp.abs(v).max()))
    # The reference: softmax over each query's keys, in float64 numpy.
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("btngc,bsnc->bngts", q64, k64) / np.sqrt(c)
    scores = np.where(np.asarray(mask)[:, None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bngts,bsnc->btngc", probs, v64)
    np.testing.assert_allclose(np.asarray(blocked), want, rtol=0, atol=1e-5)


def test_prefill_attention_kernel_serves_prefill_chunks(model, seqs, monkeypatch):
    """`prefill_attention="pallas"`: a padded prompt prefill and a chunk continuing it attend
    with the flash kernel (counted), decode steps do not, and the logits agree with the
    teacher-forced forward as the XLA path's do (same parameters, a differently summed softmax)."""
    from kernels_pallas.prefill_attention import kernel

    calls = []
    traced = kernel.prefill_attention_pallas
    monkeypatch.setattr(
        kernel, "prefill_attention_pallas", lambda *a, **k: calls.append(1) or traced(*a, **k)
    )
    cfg = dataclasses.replace(CFG32, prefill_attention="pallas")
    graphdef, params = nnx.graphdef(init_model(cfg, seed=3)), nnx.state(model)
    ref, _ = reference(model, seqs)
    cache = init_cache(cfg, batch=3, max_len=MAX_LEN)
    first = jnp.asarray(LENGTHS - 2)  # the prompts' last two tokens come as a second chunk
    logits, _, cache = prefill_jit(graphdef, params, cache, right_padded_prompts(seqs), first)
    assert len(calls) == cfg.n_layers
    for b, n in enumerate(first):
        assert_logits_agree(model, logits[b, :n], ref[b, :n], SEQ_LEN)
    rest = seqs[np.arange(3)[:, None], np.asarray(first)[:, None] + np.arange(2)]
    logits, _, cache = prefill_jit(graphdef, params, cache, rest, jnp.full((3,), 2))
    assert len(calls) == 2 * cfg.n_layers
    for b, n in enumerate(first):
        assert_logits_agree(model, logits[b], ref[b, n : n + 2], SEQ_LEN)
    logits, _, cache = decode_step_jit(graphdef, params, cache, continuation(seqs, 0))
    assert len(calls) == 2 * cfg.n_layers  # one query a row: the XLA path
    for b, n in enumerate(LENGTHS):
        assert_logits_agree(model, logits[b], ref[b, n], SEQ_LEN)
