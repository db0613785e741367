"""KV cache: prefill + token-by-token decode equal the teacher-forced forward (right padding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from trace_jax import fp4
from trace_jax.models import (
    PackedTensorCache,
    Qwen3MoE,
    decode_step,
    decode_step_jit,
    init_cache,
    init_model,
    prefill,
    prefill_jit,
)

CFG32 = tiny.model_config(dtype=jnp.float32, init_std=0.1)
LENGTHS = np.array([7, 3, 5])  # prompt lengths, right-padded to 7
N_DECODE = 4
MAX_LEN = 16
TOL = dict(rtol=1e-4, atol=1e-5)


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
    """[3, 11] token ids; row b is prompt b followed by its N_DECODE continuation tokens."""
    return jax.random.randint(jax.random.key(11), (3, 11), 1, CFG32.vocab_size, jnp.int32)


def right_padded_prompts(seqs: jax.Array) -> jax.Array:
    t = int(LENGTHS.max())
    keep = np.arange(t)[None, :] < LENGTHS[:, None]
    return jnp.where(keep, seqs[:, :t], 0)


def continuation(seqs: jax.Array, step: int) -> jax.Array:
    return seqs[np.arange(len(LENGTHS)), LENGTHS + step]


def kv_site(x, *, name, layer, experts=None):
    return x * 1.3 + 0.05 * (layer + 1) if name in ("k", "v") else x


@pytest.mark.parametrize("site", [None, kv_site])
def test_prefill_decode_match_forward_with_padding(model, seqs, site):
    kw = {} if site is None else {"site": site}
    ref, ref_aux = model(seqs, **kw)
    graphdef, params = nnx.split(model)
    cache = init_cache(CFG32, batch=3, max_len=MAX_LEN)
    logits, aux, cache = prefill_jit(
        graphdef, params, cache, right_padded_prompts(seqs), jnp.asarray(LENGTHS), **kw
    )
    np.testing.assert_array_equal(cache.lengths, LENGTHS)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(logits[b, :n], ref[b, :n], **TOL)
        np.testing.assert_array_equal(aux["topk_idx"][:, b, :n], ref_aux["topk_idx"][:, b, :n])
    for step in range(N_DECODE):
        logits, aux, cache = decode_step_jit(
            graphdef, params, cache, continuation(seqs, step), **kw
        )
        assert logits.shape == (3, CFG32.vocab_size) and aux["topk_idx"].shape[2] == 1
        for b, n in enumerate(LENGTHS):
            np.testing.assert_allclose(logits[b], ref[b, n + step], **TOL)
            np.testing.assert_array_equal(
                aux["topk_idx"][:, b, 0], ref_aux["topk_idx"][:, b, n + step]
            )
    np.testing.assert_array_equal(cache.lengths, LENGTHS + N_DECODE)


def test_chunked_prefill_and_decode_sites(model, seqs):
    ref, _ = model(seqs[:1, :6])
    graphdef, params = nnx.split(model)
    cache = init_cache(CFG32, batch=1, max_len=8)
    _, _, cache = prefill_jit(graphdef, params, cache, seqs[:1, :4], jnp.array([3]))  # 1 padded
    logits, _, cache = prefill_jit(graphdef, params, cache, seqs[:1, 3:5], jnp.array([2]))
    np.testing.assert_allclose(logits[0], ref[0, 3:5], **TOL)
    calls = []

    def record(x, *, name, layer, experts=None):
        calls.append((str(name), layer, tuple(x.shape)))
        return x

    # The un-jitted entry point; the site records at trace time under decode_step_jit as well.
    logits, _, cache = decode_step(model, cache, seqs[:1, 5], site=record)
    np.testing.assert_allclose(logits[0], ref[0, 5], **TOL)
    kv_shape = (1, 1, CFG32.n_kv_heads, CFG32.head_dim)
    assert ("k", 0, kv_shape) in calls and ("v", CFG32.n_layers - 1, kv_shape) in calls
    assert len(calls) == 7 * CFG32.n_layers
    assert int(cache.lengths[0]) == 6


def test_inactive_sequences_do_not_advance(model, seqs):
    graphdef, params = nnx.split(model)
    prompts = right_padded_prompts(seqs)
    outs = []
    for active in (None, jnp.array([True, False, True])):
        cache = init_cache(CFG32, batch=3, max_len=MAX_LEN)
        _, _, cache = prefill_jit(graphdef, params, cache, prompts, jnp.asarray(LENGTHS))
        logits, _, cache = decode_step_jit(
            graphdef, params, cache, continuation(seqs, 0), active=active
        )
        logits, _, cache = decode_step_jit(graphdef, params, cache, continuation(seqs, 1))
        outs.append((logits, cache.lengths))
    (full, _), (partial, partial_len) = outs
    np.testing.assert_array_equal(partial_len, LENGTHS + np.array([2, 1, 2]))
    np.testing.assert_allclose(partial[0], full[0], **TOL)
    np.testing.assert_allclose(partial[2], full[2], **TOL)


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


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
def test_packed_cache_is_head_major_and_reads_back_the_quantizer(fmt):
    """Writes land at (b, kv head, slot) of the head-major arrays, exactly the quantizer's packed
    codes; out-of-range slots are dropped; `read` gives [B, S, Hkv, Dh] = the quantizer's values
    at written slots and zeros elsewhere."""
    b, s, hkv, dh, t = 2, 6, 3, 32, 2
    x = 3.0 * jax.random.normal(jax.random.key(8), (b, t, hkv, dh))
    slots = jnp.array([[4, 1], [0, s]])  # row 1's second token is out of range: dropped
    cache = PackedTensorCache.empty((b, s, hkv, dh), fmt).write(x, slots)
    assert cache.shape == (b, s, hkv, dh) and cache.codes.shape == (b, hkv, s, dh // 2)
    q = fp4.quantize(x, fmt)
    packed = np.asarray(fp4.pack_fp4(q.codes))
    codes = np.asarray(cache.codes)
    for bi, ti, si in ((0, 0, 4), (0, 1, 1), (1, 0, 0)):
        for h in range(hkv):
            np.testing.assert_array_equal(codes[bi, h, si], packed[bi, ti, h])
    assert not codes[1, :, 1:].any() and not codes[0, :, [0, 2, 3, 5]].any()
    got = np.asarray(cache.read(jnp.float32))
    want = np.zeros((b, s, hkv, dh), np.float32)
    deq = np.asarray(fp4.dequantize(q))
    want[0, 4], want[0, 1], want[1, 0] = deq[0, 0], deq[0, 1], deq[1, 0]
    np.testing.assert_array_equal(got, want)
