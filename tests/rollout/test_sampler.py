"""The rollout sampler: lengths, stop tokens, padding, log-probs, packed FP4 KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from tests.models.rounding import ELEMENTWISE, U32, decided, logits_bound, routing_decided
from trace_jax import fp4
from trace_jax.models import PackedLayerKVCache, init_cache, init_model
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rollout import Rollout, SamplingConfig, generate
from trace_jax.rollout.sampler import pack_rows, unpack_rows
from trace_jax.rollout.sampling import filter_logits
from trace_jax.train import train_forward

# One worker runs the module: its tests share the module's rollouts and compiled samplers.
pytestmark = [
    pytest.mark.usefixtures("pallas_interpreted_on_cpu"),
    pytest.mark.xdist_group("sampler"),
]

CFG32 = tiny.model_config(dtype=jnp.float32, init_std=0.08)
QCFG = QuantConfig.nvfp4()


@pytest.fixture(scope="module")
def model():
    return init_model(CFG32, seed=1)


def _prompts():
    prompts = jnp.array([[3, 5, 7, 9, 11, 0], [2, 4, 6, 8, 10, 12], [1, 1, 0, 0, 0, 0]], jnp.int32)
    return prompts, jnp.array([5, 6, 2], jnp.int32)


def _generate(model, prompts, lengths, **kw):
    gd, params = nnx.split(model)
    sampling = kw.pop("sampling", SamplingConfig(max_new_tokens=6, temperature=0.0))
    return generate(gd, params, prompts, lengths, jax.random.key(0), sampling=sampling, **kw)


# The module's shared rollouts of `_prompts()`: 6 greedy new tokens at the highest matmul
# precision (tests that roll out again under the same settings run the same compiled sampler).
@pytest.fixture(scope="module")
def off_rollout(model):
    """SiteMode.OFF (no FP4 site)."""
    with jax.default_matmul_precision("highest"):
        return _generate(model, *_prompts(), qcfg=QCFG, mode=SiteMode.OFF)


@pytest.fixture(scope="module")
def rtn_rollout(model):
    """SiteMode.RTN (FP4 sites), nothing captured."""
    with jax.default_matmul_precision("highest"):
        return _generate(model, *_prompts(), qcfg=QCFG, mode=SiteMode.RTN)


@pytest.fixture(scope="module")
def full_guidance_rollout(model):
    """SiteMode.RTN, full guidance captured at every site, the prompts prefilled in one piece."""
    kw = dict(capture=QCFG.all_keys(CFG32.n_layers), capture_mode=fp4.GuidanceMode.FULL)
    with jax.default_matmul_precision("highest"):
        return _generate(model, *_prompts(), qcfg=QCFG, mode=SiteMode.RTN, **kw)


def _second_new_token_of_row_0(rollout) -> int:
    return int(np.asarray(rollout.tokens)[0, int(_prompts()[1][0]) + 1])


# Jitted: eagerly, every op of the model compiles on its own (several times one program's compile).
_train_forward = nnx.jit(train_forward, static_argnames=("qcfg", "mode", "replay", "temperature"))


@nnx.jit
def _forward(model, tokens, mask):
    return model(tokens, mask=mask)


def test_layout_lengths_and_logprobs(model, off_rollout):
    prompts, lengths = _prompts()
    r = off_rollout
    with jax.default_matmul_precision("highest"):
        fwd = _train_forward(model, r, qcfg=QCFG, mode=SiteMode.OFF, temperature=1.0)
    tokens = np.asarray(r.tokens)
    np.testing.assert_array_equal(np.asarray(r.lengths), np.asarray(lengths) + 6)
    for b in range(3):
        n = int(lengths[b])
        np.testing.assert_array_equal(tokens[b, :n], np.asarray(prompts)[b, :n])
        assert np.asarray(r.response_mask)[b].sum() == 6
        assert np.asarray(r.response_mask)[b, n : n + 6].all()
        assert (tokens[b, n + 6 :] == 0).all()
    # Greedy token-by-token decode over the cache = the teacher-forced forward (float32 model),
    # to rounding: the two sum in different orders. No token is near a routing tie, so both
    # route alike; a log-softmax moves by at most twice its logits' error, each within
    # `logits_bound` (beta), plus its own rounding (V + a few terms).
    t = tokens.shape[1]
    valid = np.arange(t) < np.asarray(r.lengths)[:, None]
    with jax.default_matmul_precision("highest"):
        logits, aux = _forward(model, r.tokens, valid)
    proc = np.asarray(r.processed)
    assert routing_decided(model, aux["router_probs"], t)[:, proc].all()
    np.testing.assert_array_equal(
        np.asarray(aux["topk_idx"])[:, proc], np.asarray(r.expert_choices)[:, proc]
    )
    beta = float(logits_bound(model, t).max())
    mask = np.asarray(r.response_mask)
    lp, lp_fwd = np.asarray(r.logprobs)[mask], np.asarray(fwd.logprobs)[mask]
    rounding = (CFG32.vocab_size + ELEMENTWISE) * U32 * (np.abs(lp) + np.abs(lp_fwd) + 1)
    assert np.all(np.abs(lp_fwd - lp) <= 4 * beta + rounding)
    # Greedy picks the argmax of the forward's logits: every pick leads by more than the two
    # computations' difference (2 beta), so the comparison is exact.
    picks = np.stack([np.asarray(logits)[b, int(lengths[b]) - 1 :][:6] for b in range(3)])
    assert decided(picks, 1, 4 * beta).all()
    pred = np.argmax(picks, -1)
    for b in range(3):
        n = int(lengths[b])
        np.testing.assert_array_equal(tokens[b, n : n + 6], pred[b])


def _copies(x: jax.Array, b: int) -> jax.Array:
    """Row b of `x` in every row (x's shape)."""
    return jnp.broadcast_to(x[b : b + 1], x.shape)


def test_rows_do_not_depend_on_other_rows_or_padding(model, rtn_rollout):
    """Row 2 (a 2-token prompt) samples the same tokens with the same log-probs and experts
    whatever the other rows and its padding slots hold. Both batches have the same shapes, so
    they run the same compiled computation (the same summation order in every matmul) and agree
    bit for bit unless a row leaks into another or padding is read."""
    prompts, lengths = _prompts()
    others = jnp.array([[13, 17, 19, 23, 29, 31], [40, 41, 42, 0, 0, 0], [1, 1, 62, 62, 62, 62]])
    others_lengths = jnp.array([6, 3, 2], jnp.int32)
    assert (others[2, :2] == prompts[2, :2]).all() and int(others_lengths[2]) == int(lengths[2])
    batch = rtn_rollout
    with jax.default_matmul_precision("highest"):
        among_others = _generate(model, others, others_lengths, qcfg=QCFG, mode=SiteMode.RTN)
    for field in ("tokens", "logprobs"):
        np.testing.assert_array_equal(
            np.asarray(getattr(batch, field))[2], np.asarray(getattr(among_others, field))[2]
        )
    np.testing.assert_array_equal(
        np.asarray(batch.expert_choices)[:, 2], np.asarray(among_others.expert_choices)[:, 2]
    )


def test_stop_tokens_end_rows(model, off_rollout):
    prompts, lengths = _prompts()
    stop = _second_new_token_of_row_0(off_rollout)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, stop_tokens=(stop,), pad_id=63)
    with jax.default_matmul_precision("highest"):
        r = _generate(model, prompts, lengths, qcfg=QCFG, mode=SiteMode.OFF, sampling=sampling)
    tokens, resp = np.asarray(r.tokens), np.asarray(r.response_mask)
    n0 = int(lengths[0])
    assert int(r.lengths[0]) == n0 + 2 and tokens[0, n0 + 1] == stop
    assert (tokens[0, n0 + 2 :] == 63).all() and resp[0].sum() == 2
    for b in range(3):  # every row ends at its first stop token or at max_new_tokens
        new = tokens[b, int(lengths[b]) : int(r.lengths[b])]
        hits = np.nonzero(new == stop)[0]
        assert len(new) == (hits[0] + 1 if len(hits) else 6)


def test_records_of_rows_that_end_early_sit_at_their_slots(model, rtn_rollout):
    """Expert choices and guidance of rows ending at different steps (a stop token, the length
    limit) equal each row's records in a batch of copies of itself (where every row ends when it
    does), and slots after a row's end keep the empty buffer's values."""
    prompts, lengths = _prompts()
    stop = _second_new_token_of_row_0(rtn_rollout)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, stop_tokens=(stop,))
    keys = QCFG.all_keys(CFG32.n_layers)
    kw = dict(qcfg=QCFG, mode=SiteMode.RTN, sampling=sampling, capture=keys)
    with jax.default_matmul_precision("highest"):
        batch = _generate(model, prompts, lengths, **kw)
        # The same shapes as `batch`: the same compiled computation and summation order, so row b
        # must come out bit for bit (codes, scales and expert choices are discrete functions of
        # its values, which a different batch shape would perturb by rounding).
        alone = [_generate(model, _copies(prompts, b), _copies(lengths, b), **kw) for b in range(3)]
    ends = np.asarray(batch.lengths) - np.asarray(lengths)
    assert ends[0] == 2 and len(set(ends.tolist())) > 1  # rows end at different steps
    proc = np.asarray(batch.processed)
    for b, r in enumerate(alone):
        np.testing.assert_array_equal(np.asarray(r.processed)[b], proc[b])
        p = proc[b]
        np.testing.assert_array_equal(
            np.asarray(batch.expert_choices)[:, b], np.asarray(r.expert_choices)[:, b]
        )
        assert (np.asarray(batch.expert_choices)[:, b, ~p] == 0).all()
        for k in keys:  # compact guidance: payload bits, block scales, global scale
            ga, gb = batch.guidance[k], r.guidance[k]
            assert ga.mode is fp4.GuidanceMode.COMPACT
            for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
                np.testing.assert_array_equal(np.asarray(u)[b], np.asarray(v)[b])
            assert (np.asarray(ga.payload)[b, ~p] == 0).all()
    # Slot alignment against an independent path: teacher-forced prefill of each finished row
    # (all its tokens as the prompt) records its guidance at the same slots.
    tokens, width = np.asarray(batch.tokens), int(batch.lengths.max())
    one = SamplingConfig(max_new_tokens=1, temperature=0.0)
    for b in range(3):  # one shape for every row (right-padded prompts): one compile
        n = int(batch.lengths[b])
        with jax.default_matmul_precision("highest"):
            tf = _generate(
                model,
                jnp.asarray(tokens[b : b + 1, :width]),
                jnp.array([n]),
                **{**kw, "sampling": one},
            )
        p = proc[b][:n]  # processed slots [0, n - 1)
        for k in keys:
            u = np.asarray(batch.guidance[k].payload)[b, :n][p]
            v = np.asarray(tf.guidance[k].payload)[0, :n][p]
            # Decode and prefill sum in different orders, so a bit may flip where a value sits
            # at a rounding boundary (none here); a slot off by one agrees on at most 86% of the
            # payload bytes here.
            assert (u == v).mean() > 0.98, (k, (u == v).mean())


def test_new_token_limit_ends_rows_early_from_one_compiled_rollout(model, rtn_rollout):
    """A traced `new_token_limit` ends rows after that many new tokens, in one compiled rollout
    for every limit: at `max_new_tokens` it is the unlimited rollout bit for bit; at 3 each row
    is the unlimited rollout's row cut after min(3, its own length) new tokens (row 0 stops at
    its second token either way), records included, and decode slots after the cut stay
    empty."""
    prompts, lengths = _prompts()
    stop = _second_new_token_of_row_0(rtn_rollout)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, stop_tokens=(stop,))
    keys = QCFG.all_keys(CFG32.n_layers)
    kw = dict(qcfg=QCFG, mode=SiteMode.RTN, sampling=sampling, capture=keys)
    gd, params = nnx.split(model)

    def limited(n):
        return generate(gd, params, prompts, lengths, jax.random.key(0), jnp.int32(n), **kw)

    with jax.default_matmul_precision("highest"):
        full = _generate(model, prompts, lengths, **kw)
        at_max = limited(6)
        compiled = generate._cache_size()
        cut = limited(3)
    assert generate._cache_size() == compiled  # the limit is traced: no second compile
    for got, want in zip(jax.tree.leaves(at_max), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    full_new = np.asarray(full.lengths - lengths)
    assert full_new[0] == 2 and (full_new[1:] > 3).any()  # both ways of ending occur
    want_lengths = np.asarray(lengths) + np.minimum(full_new, 3)
    np.testing.assert_array_equal(np.asarray(cut.lengths), want_lengths)
    s = np.arange(full.tokens.shape[1])[None, :]
    kept, proc = s < want_lengths[:, None], np.asarray(cut.processed)
    tokens = np.where(kept, np.asarray(full.tokens), sampling.pad_id)
    np.testing.assert_array_equal(np.asarray(cut.tokens), tokens)
    mask = np.asarray(full.response_mask) & kept
    np.testing.assert_array_equal(np.asarray(cut.response_mask), mask)
    np.testing.assert_array_equal(np.asarray(cut.logprobs), np.where(kept, full.logprobs, 0.0))
    # records: the unlimited rollout's at processed slots; decode slots after the cut stay empty
    # (prefill writes every slot of the prompt buffer, padding too: valid only where processed)
    empty = ~proc & (s >= prompts.shape[1])
    got, want = np.asarray(cut.expert_choices), np.asarray(full.expert_choices)
    np.testing.assert_array_equal(got[:, proc], want[:, proc])
    assert (got[:, empty] == 0).all() and empty.any()
    for k, g in cut.guidance.items():
        for u, v in zip(jax.tree.leaves(g), jax.tree.leaves(full.guidance[k]), strict=True):
            np.testing.assert_array_equal(np.asarray(u)[proc], np.asarray(v)[proc])
        assert (np.asarray(g.payload)[empty] == 0).all()
    with pytest.raises(ValueError, match="new_token_limit must be an integer scalar"):
        limited(jnp.array([3, 3]))


def test_chunked_prefill_rollout_equals_one_piece(model, full_guidance_rollout):
    """`prefill_chunk_tokens` bounds memory, not results: with chunks of whole prompts (2 rows of
    3: the last chunk overlaps) the rollout is the one-piece rollout bit for bit (tokens,
    log-probs, expert choices, guidance at every slot); chunks of 4 of the 6 prompt positions
    sum attention in another order (`tests/rollout/test_prefill.py`): the same greedy tokens and
    expert choices, log-probs within float32 rounding."""
    prompts, lengths = _prompts()
    keys = QCFG.all_keys(CFG32.n_layers)
    kw = dict(qcfg=QCFG, mode=SiteMode.RTN, capture=keys, capture_mode=fp4.GuidanceMode.FULL)

    def rollout(chunk_tokens):
        sampling = SamplingConfig(
            max_new_tokens=6, temperature=0.0, prefill_chunk_tokens=chunk_tokens
        )
        with jax.default_matmul_precision("highest"):
            return _generate(model, prompts, lengths, sampling=sampling, **kw)

    one_piece, rows, positions = full_guidance_rollout, rollout(12), rollout(4)
    for got, want in zip(jax.tree.leaves(rows), jax.tree.leaves(one_piece), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for field in ("tokens", "lengths", "expert_choices"):
        np.testing.assert_array_equal(
            np.asarray(getattr(positions, field)), np.asarray(getattr(one_piece, field))
        )
    np.testing.assert_allclose(positions.logprobs, one_piece.logprobs, rtol=0, atol=1e-5)


def test_temperature_sampling_and_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_array_equal(
        filter_logits(logits, SamplingConfig(max_new_tokens=1, top_k=2)) > -1e29, [[1, 1, 0, 0]]
    )
    np.testing.assert_array_equal(
        filter_logits(logits, SamplingConfig(max_new_tokens=1, top_p=0.7)) > -1e29, [[1, 1, 0, 0]]
    )
    np.testing.assert_array_equal(
        filter_logits(logits, SamplingConfig(max_new_tokens=1, top_p=0.81)) > -1e29,
        [[1, 1, 1, 0]],
    )
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)


def test_packed_cache_holds_the_sites_codes(full_guidance_rollout):
    r = full_guidance_rollout
    cache = init_cache(CFG32, batch=3, max_len=12, kv_format="nvfp4")
    assert isinstance(cache.layers[0], PackedLayerKVCache)
    assert cache.layers[0].k.codes.dtype == jnp.uint8 and cache.layers[0].k.codes.shape[-1] == 8
    # FP4 cache bytes per element: 4 bits + E4M3 scale / 16 + f32 global scale / head_dim.
    per_el = cache.layers[0].k.nbytes * 8 / (3 * 12 * CFG32.n_kv_heads * CFG32.head_dim)
    assert per_el == pytest.approx(4 + 8 / 16 + 32 / 16)
    g = r.guidance[f"{CFG32.n_layers - 1}/k"]
    assert g.rollout_codes().shape == (3, 12, CFG32.n_kv_heads, CFG32.head_dim)
    # Codes are FP4 codes at processed slots; scales are finite there.
    proc = np.asarray(r.processed)
    sc = np.asarray(fp4.scales_to_float32(g.scales, g.fmt))[proc]
    assert np.isfinite(sc).all() and (sc > 0).all()


def test_bad_inputs(model):
    prompts, lengths = _prompts()
    with pytest.raises(ValueError, match=r"SiteMode\.RTN"):
        _generate(model, prompts, lengths, qcfg=QCFG, mode=SiteMode.GUIDED)
    with pytest.raises(ValueError, match="lengths must be"):
        _generate(model, prompts, lengths[:2], qcfg=QCFG)
    with pytest.raises(ValueError, match="implementation must be 'xla' or 'pallas', got 'auto'"):
        _generate(model, prompts, lengths, qcfg=QCFG, implementation="auto")
    with pytest.raises(ValueError, match="not a multiple"):
        init_cache(CFG32, batch=1, max_len=4, kv_format="mxfp4")  # head_dim 16 < block 32


def test_mxfp4_rollout_is_finite():
    """Regression: unwritten packed-cache slots must hold finite scales (E8M0 zeros are NaN).
    One block: every block's cache is alike (a block less is about 40% less to compile)."""
    cfg = tiny.model_config(head_dim=32, n_layers=1)
    qcfg = QuantConfig.mxfp4_w4a4()
    m = init_model(cfg, seed=0)
    prompts, lengths = _prompts()
    cache = init_cache(cfg, batch=1, max_len=4, kv_format="mxfp4")
    assert np.isfinite(np.asarray(cache.layers[0].k.read(jnp.float32))).all()
    r = _generate(
        m, prompts, lengths, qcfg=qcfg, mode=SiteMode.RTN, capture=qcfg.guided_keys(cfg.n_layers)
    )
    assert np.isfinite(np.asarray(r.logprobs)).all()
    out = _train_forward(m, r, qcfg=qcfg, mode=SiteMode.GUIDED, replay=True)
    assert np.isfinite(np.asarray(out.logprobs)).all()


def test_bf16_decode_matches_teacher_forced_forward():
    """bf16 compute, both paths jitted: per-token log-probs agree to bf16 rounding (0.05 max).
    One block: the paths' rounding differs within every block alike (a block less is about 40%
    less to compile)."""
    cfg = tiny.model_config(init_std=0.08, n_layers=1)
    m = init_model(cfg, seed=3)
    prompts, lengths = _prompts()
    r = _generate(
        m,
        prompts,
        lengths,
        qcfg=QCFG,
        mode=SiteMode.OFF,
        sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
    )
    fwd = _train_forward(m, r, qcfg=QCFG, mode=SiteMode.OFF)
    mask = np.asarray(r.response_mask)
    diff = np.abs(np.asarray(fwd.logprobs) - np.asarray(r.logprobs))[mask]
    assert diff.max() < 0.05 and diff.mean() < 5e-3, (diff.max(), diff.mean())


def _pallas_and_xla_rollouts(dtype, seed=0):
    # The kernel needs Dh >= 32.
    cfg = tiny.model_config(head_dim=32, init_std=0.08, dtype=dtype)
    m = init_model(cfg, seed=seed)
    prompts, lengths = _prompts()
    keys = QCFG.all_keys(cfg.n_layers)
    kw = dict(qcfg=QCFG, capture=keys, capture_mode=fp4.GuidanceMode.FULL)
    a = _generate(m, prompts, lengths, implementation="xla", **kw)
    # The Pallas rollout prefills in chunks of 2 of the 3 prompts (the kernels inside the chunk
    # loop, as on a GPU at long prompts); chunks of whole prompts change no result.
    chunked = SamplingConfig(max_new_tokens=6, temperature=0.0, prefill_chunk_tokens=12)
    b = _generate(m, prompts, lengths, implementation="pallas", sampling=chunked, **kw)
    prompt = np.arange(a.tokens.shape[1])[None] < np.asarray(lengths)[:, None]
    return a, b, keys, prompt


# Sites whose inputs both implementations compute with the same XLA ops at prompt slots (the
# prefill's attention is XLA in both; the fused quantize kernel is bit-exact): identical guidance.
SAME_INPUT_SITES = ("0/k", "0/v", "0/expert_in")


def test_pallas_implementation_matches_xla():
    """implementation="pallas" (interpret mode here: fused quantize + capture, FP4 decode
    attention, FP4 MoE matmul on weights packed once) in float32 compute: the same greedy tokens
    as the XLA path (the smallest greedy lead here is 3e-2, the paths' log-probs differ by ~7e-7);
    identical guidance where both paths see identical inputs; elsewhere the kernels sum in another
    order, which flips a code only where a value sits within rounding of an FP4 rounding boundary:
    at most 1% of a site's codes and block scales (none measured; a wiring error, another layer's
    weights or a lost scale, changes most codes from the first layer it enters). The 2-block
    tiny model: its first and last block hold every site kind and the path between blocks."""
    a, b, keys, prompt = _pallas_and_xla_rollouts(jnp.float32)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    proc = np.asarray(a.processed)
    for k in keys:
        ga, gb = a.guidance[k], b.guidance[k]
        codes_a, codes_b = (np.asarray(g.rollout_codes()) for g in (ga, gb))
        scales_a, scales_b = (np.asarray(fp4.scales_to_float32(g.scales, g.fmt)) for g in (ga, gb))
        if k in SAME_INPUT_SITES:
            np.testing.assert_array_equal(codes_a[prompt], codes_b[prompt])
            np.testing.assert_array_equal(scales_a[prompt], scales_b[prompt])
        for u, v in ((codes_a, codes_b), (scales_a, scales_b)):
            assert np.mean(u[proc] != v[proc]) <= 0.01, (k, np.mean(u[proc] != v[proc]))


def test_pallas_implementation_close_to_xla_in_bf16():
    """In bfloat16 the paths compute different numbers, the kernels the more faithful ones: XLA's
    fake quantization rounds dequantized NVFP4 values (code * scale * float32 global scale) to
    bf16 before `ragged_dot`, and its attention rounds probabilities to bf16, while the kernels
    decode exact FP4 values, apply global scales in float32 and keep float16 probabilities. FP4
    sites turn these differences into code flips that compound with depth, so: greedy tokens
    (measured: all equal) at most one apart, response log-probs within 0.2, and
    in layer 0, where both paths see identical inputs, (almost) the same codes. The bounds are
    measurements of this model (2 blocks, seed 2: no greedy token differs, log-probs within
    0.054, 1.1% of layer 0's expert_mid codes; seeds 0 and 4 have 2-3 differing tokens)."""
    a, b, keys, prompt = _pallas_and_xla_rollouts(jnp.bfloat16, seed=2)
    resp = np.asarray(a.response_mask) & np.asarray(b.response_mask)
    ta, tb = np.asarray(a.tokens), np.asarray(b.tokens)
    assert (ta != tb)[resp].sum() <= 1
    # Log-probs of each row up to its first differing token (inputs identical until then).
    same_so_far = np.cumsum(ta != tb, axis=1) == 0
    diff = np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))[resp & same_so_far]
    assert diff.size >= 10 and diff.max() < 0.2, diff.max()
    for k in [k for k in keys if k.startswith("0/")]:
        ca = np.asarray(a.guidance[k].rollout_codes())[prompt]
        cb = np.asarray(b.guidance[k].rollout_codes())[prompt]
        # expert_mid follows the first expert matmuls (measured 1.1% flips); the rest are equal.
        assert np.mean(ca != cb) <= (0.03 if k.endswith("expert_mid") else 0.0), k


def test_rollout_rows_selects_every_field_on_its_batch_axis():
    b, s, n_layers, k = 4, 6, 2, 2
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(b, s, 32)), jnp.float32)
    g = fp4.make_guidance(fp4.quantize(x, "nvfp4"), "compact")
    r = Rollout(
        tokens=jnp.asarray(rng.integers(0, 9, (b, s)), jnp.int32),
        prompt_lengths=jnp.arange(b, dtype=jnp.int32),
        lengths=jnp.arange(b, dtype=jnp.int32) + 3,
        logprobs=jnp.asarray(rng.normal(size=(b, s)), jnp.float32),
        response_mask=jnp.asarray(rng.random((b, s)) < 0.5),
        expert_choices=jnp.asarray(rng.integers(0, 4, (n_layers, b, s, k)), jnp.int32),
        guidance={"0/k": g},
    )
    part = r.rows(slice(1, 3))
    np.testing.assert_array_equal(part.tokens, r.tokens[1:3])
    np.testing.assert_array_equal(part.lengths, r.lengths[1:3])
    np.testing.assert_array_equal(part.expert_choices, r.expert_choices[:, 1:3])
    for u, v in zip(jax.tree.leaves(part.guidance), jax.tree.leaves(r.guidance), strict=True):
        np.testing.assert_array_equal(u, v[1:3])
    assert part.guidance["0/k"].mode is g.mode and part.guidance["0/k"].fmt is g.fmt


def test_pallas_implementation_runs_prequantized_weights_unpacked():
    """Post-training-quantized weights (QuantConfig.weights_prequantized) are not re-packed by the
    Pallas implementation: the same greedy tokens as the XLA one (float32 compute)."""
    from flax import nnx as _nnx

    from trace_jax.quant import ptq

    cfg = tiny.model_config(head_dim=32, init_std=0.08, dtype=jnp.float32)
    m = init_model(cfg, seed=0)
    ptq.quantize_model_experts(m, "4over6")
    qcfg = QuantConfig.nvfp4(weights_prequantized=True)
    prompts, lengths = _prompts()
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    gd, params = _nnx.split(m)
    out = [
        generate(gd, params, prompts, lengths, jax.random.key(0), sampling=sampling, qcfg=qcfg,
                 implementation=impl)
        for impl in ("xla", "pallas")
    ]  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out[0].tokens), np.asarray(out[1].tokens))


def test_pack_rows_round_trips_mixed_dtypes():
    """A decode step's records (int32 experts, uint8 payload, FP8 scales, f32 global scales)
    packed into one byte row per batch row and back, against numpy's own byte views."""
    rng = np.random.default_rng(0)
    b = 3
    arrays = [
        rng.integers(-(2**31), 2**31 - 1, (b, 4, 1, 2), dtype=np.int32),
        rng.integers(0, 256, (b, 1, 5), dtype=np.uint8),
        rng.normal(size=(b, 1, 2, 3)).astype(ml_dtypes.float8_e4m3fn),
        (2.0 ** rng.integers(-8, 8, (b, 1, 7))).astype(ml_dtypes.float8_e8m0fnu),
        rng.normal(size=(b, 1, 1)).astype(np.float32),
    ]
    packed = np.asarray(pack_rows([jnp.asarray(a) for a in arrays]))
    want = np.concatenate([a.reshape(b, -1).view(np.uint8).reshape(b, -1) for a in arrays], 1)
    np.testing.assert_array_equal(packed, want)
    # Unpacked with a leading step axis, as the sampler's step buffers are.
    steps = np.stack([packed, packed[::-1]])
    like = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    for a, u in zip(arrays, unpack_rows(jnp.asarray(steps), like), strict=True):
        assert u.dtype == a.dtype and u.shape == (2, *a.shape)
        np.testing.assert_array_equal(np.asarray(u[0]).view(np.uint8), a.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(u[1]).view(np.uint8), a[::-1].view(np.uint8))
    with pytest.raises(ValueError, match="bytes"):
        unpack_rows(jnp.asarray(packed), like[:-1])
