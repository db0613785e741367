"""The tiled grouped matmul against `jax.lax.ragged_dot` and a float64 numpy reference: values
and gradients, ragged groups with empty ones, rows past the groups, bad shapes; the Pallas choice
(interpret mode): the routed experts' forward against `ragged_dot`, gradients equal to the tiled
form's; `auto` on a faked GPU and CPU; and the model with `grouped_matmul="tiled"` against the
default."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas import common
from tests.models.rounding import U32, assert_logits_agree, experts_bound, routing_decided
from trace_jax.models import ModelConfig, MoE, init_model, route
from trace_jax.models import grouped_matmul as gm
from trace_jax.models.grouped_matmul import default_tile, grouped_dot, tiled_ragged_dot
from trace_jax.models.moe import experts_grouped

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def _numpy_ragged(lhs, rhs, sizes):
    """ragged_dot in float64: lhs [M, K], rhs [E, K, N] -> [M, N]."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for e, g in enumerate(sizes):
        out[start : start + g] = lhs[start : start + g].astype(np.float64) @ rhs[e]
        start += g
    return out


def _group_outer(lhs, cot, sizes):
    """Per group e, lhs_e^T cot_e in float64: lhs [M, K], cot [M, N] -> [E, K, N]."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return np.stack([lhs[a:b].T @ cot[a:b] for a, b in itertools.pairwise(bounds)])


@pytest.mark.parametrize(
    "sizes,tile",
    [
        ((5, 0, 9, 3, 0, 7), 4),  # empty groups, groups not multiples of the tile
        ((16, 16), 8),  # whole tiles
        ((0, 0, 11), None),  # default tile; only the last group
        ((3, 2, 1), 8),  # 6 rows of 10 in groups: the rest belongs to none (zeros)
    ],
)
def test_matches_ragged_dot_and_float64(sizes, tile):
    rng = np.random.default_rng(sum(sizes))
    m = max(sum(sizes), 10)
    lhs = rng.normal(size=(m, 12)).astype(np.float32)
    rhs = rng.normal(size=(len(sizes), 12, 7)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(tiled_ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), gs, tile=tile))
        want = np.asarray(jax.lax.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), gs))
    # A float32 dot of K terms in any order is within K u sum|products| of exact.
    bound = lhs.shape[1] * U32 * _numpy_ragged(np.abs(lhs), np.abs(rhs), sizes)
    assert np.all(np.abs(got - _numpy_ragged(lhs, rhs, sizes)) <= bound)
    assert np.all(np.abs(got - want) <= 2 * bound)
    assert (got[sum(sizes) :] == 0).all()


def test_gradients_match_ragged_dot():
    rng = np.random.default_rng(1)
    sizes = jnp.asarray((4, 0, 6, 5), jnp.int32)
    lhs = jnp.asarray(rng.normal(size=(15, 8)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(15, 6)), jnp.float32)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b) * cot)

    tiled = jax.grad(lambda a, b: loss(lambda x, w: tiled_ragged_dot(x, w, sizes, tile=4), a, b),
                     argnums=(0, 1))(lhs, rhs)  # fmt: skip
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(lambda a, b: loss(lambda x, w: jax.lax.ragged_dot(x, w, sizes), a, b),
                       argnums=(0, 1))(lhs, rhs)  # fmt: skip
    # Each gradient is a dot in float32, in any order within n u sum|products| of exact: d lhs
    # = cot rhs[g]^T sums N terms, d rhs[g] = lhs_g^T cot_g the group's rows (at most 6).
    a, w, c = (np.abs(np.asarray(v, np.float64)) for v in (lhs, rhs, cot))
    bounds = (
        w.shape[2] * U32 * _numpy_ragged(c, np.swapaxes(w, 1, 2), np.asarray(sizes)),
        int(max(sizes)) * U32 * _group_outer(a, c, np.asarray(sizes)),
    )
    for g, r, bound in zip(tiled, ref, bounds, strict=True):
        assert np.all(np.abs(np.asarray(g, np.float64) - np.asarray(r)) <= 2 * bound)
    assert float(jnp.abs(tiled[1][1]).max()) == 0.0  # the empty group gets no gradient


def test_bad_shapes_and_default_tile():
    with pytest.raises(ValueError, match="do not fit"):
        tiled_ragged_dot(jnp.zeros((4, 3)), jnp.zeros((2, 5, 2)), jnp.zeros((2,), jnp.int32))
    assert default_tile(98304, 32) == 128 and default_tile(64, 32) == 8 and default_tile(40, 4) == 8
    assert default_tile(1000, 8) == 64
    with pytest.raises(ValueError):
        grouped_dot(jnp.zeros((4, 3)), jnp.zeros((2, 3, 2)), jnp.zeros((2,), jnp.int32), "dense")


def test_auto_tiles_only_many_rows_per_group_off_gpu(monkeypatch):
    monkeypatch.setattr(common, "kernel_platform", lambda: "cpu")
    assert gm.resolve("auto", 128 * 32, 32) is gm.GroupedMatmul.TILED  # training / prefill
    assert gm.resolve("auto", 128 * 32 - 1, 32) is gm.GroupedMatmul.RAGGED_DOT  # decode
    assert gm.resolve("tiled", 4, 32) is gm.GroupedMatmul.TILED  # explicit choices stand
    assert gm.resolve("ragged_dot", 10**6, 2) is gm.GroupedMatmul.RAGGED_DOT
    assert gm.resolve("pallas", 10**6, 2) is gm.GroupedMatmul.PALLAS
    # grouped_dot follows the resolution: each path is taken where resolve says.
    calls = []
    monkeypatch.setattr(gm, "tiled_ragged_dot", lambda *a, **k: calls.append("tiled") or a[0])
    monkeypatch.setattr(gm.jax.lax, "ragged_dot", lambda *a, **k: calls.append("ragged") or a[0])
    sizes = jnp.array([3, 5], jnp.int32)
    gm.grouped_dot(jnp.ones((256, 4)), jnp.ones((2, 4, 4)), sizes, "auto")
    gm.grouped_dot(jnp.ones((255, 4)), jnp.ones((2, 4, 4)), sizes, "auto")
    assert calls == ["tiled", "ragged"]


def test_auto_is_pallas_on_a_gpu(monkeypatch):
    monkeypatch.setattr(common, "kernel_platform", lambda: "gpu")
    for m in (8, 128 * 32, 10**6):  # decode, prefill and training shapes alike
        assert gm.resolve("auto", m, 32) is gm.GroupedMatmul.PALLAS
    assert gm.resolve("tiled", 10**6, 32) is gm.GroupedMatmul.TILED  # explicit choices stand
    assert gm.resolve("ragged_dot", 8, 32) is gm.GroupedMatmul.RAGGED_DOT


def test_pallas_needs_native_pallas_or_interpretation():
    """`pallas` where Pallas does not compile and nothing asked for interpretation raises rather
    than fall back to `ragged_dot` unseen; on a TPU `auto` is `pallas` (megablox)."""
    args = jnp.ones((4, 8)), jnp.ones((2, 8, 16)), jnp.array([2, 2], jnp.int32)
    with common.lowering_for("cpu"), common.interpreting(False):
        with pytest.raises(common.PallasUnavailableError, match="platform 'cpu'"):
            grouped_dot(*args, "pallas")
    with common.lowering_for("tpu"):
        assert gm.resolve("auto", 8, 32) is gm.GroupedMatmul.PALLAS


def test_experts_with_pallas_match_ragged_dot(monkeypatch):
    """The routed experts with the Pallas kernel (interpret mode) for all three projections
    against `ragged_dot`: each within its float32 rounding bound of exact math."""
    cfg = ModelConfig.tiny(dtype=jnp.float32, init_std=0.1)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model), jnp.float32)
    logits = jax.random.normal(jax.random.key(2), (2, 5, cfg.n_experts), jnp.float32)
    routing = route(logits, top_k=cfg.top_k, norm_topk_prob=True)
    weights = [moe.w_gate[...], moe.w_up[...], moe.w_down[...]]
    kernel_calls = []
    kernel = gm.grouped_matmul
    monkeypatch.setattr(
        gm, "grouped_matmul", lambda *a, **k: kernel_calls.append(k) or kernel(*a, **k)
    )
    y_pallas = experts_grouped(x, *weights, routing, layer=0, matmul="pallas")
    assert len(kernel_calls) == 3  # gate, up, down
    y_ref = experts_grouped(x, *weights, routing, layer=0, matmul="ragged_dot")
    _, bound = experts_bound(moe, x, routing)
    err = np.abs(np.asarray(y_pallas, np.float64) - np.asarray(y_ref, np.float64))
    assert np.all(err <= 2 * bound + U32 * np.abs(np.asarray(y_ref))), err.max()


def test_pallas_gradients_are_the_tiled_forms():
    """`pallas`: forward by the kernel, backward by `tiled_ragged_dot`'s VJP, exactly."""
    rng = np.random.default_rng(2)
    sizes = jnp.asarray((4, 0, 6, 5), jnp.int32)  # an empty group; rows 15..17 in none
    lhs = jnp.asarray(rng.normal(size=(18, 32)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(4, 32, 16)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(18, 16)), jnp.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b) * cot), argnums=(0, 1)))(lhs, rhs)

    got = grads(lambda a, b: grouped_dot(a, b, sizes, "pallas"))
    want = grads(lambda a, b: tiled_ragged_dot(a, b, sizes))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert float(jnp.abs(got[1][1]).max()) == 0.0 and float(jnp.abs(got[0][15:]).max()) == 0.0
    # The forward is the kernel's: the float64 product to float32 summation order.
    out = np.asarray(grouped_dot(lhs, rhs, sizes, "pallas"), np.float64)
    a, w = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    bound = 32 * U32 * _numpy_ragged(np.abs(a), np.abs(w), np.asarray(sizes))
    assert np.all(np.abs(out - _numpy_ragged(a, w, np.asarray(sizes))) <= bound)


def test_model_with_tiled_grouped_matmul_matches_ragged_dot():
    cfg = ModelConfig.tiny(dtype=jnp.float32, init_std=0.08)
    # A draw with no token near a routing tie (`routing_decided` holds with a wide margin).
    tokens = jax.random.randint(jax.random.key(11), (2, 9), 1, cfg.vocab_size, jnp.int32)
    with jax.default_matmul_precision("highest"):
        model = init_model(cfg, seed=3)
        ref, aux = model(tokens)
        # No token is near a routing tie: both route alike and differ by rounding only.
        assert routing_decided(model, aux["router_probs"], tokens.shape[1]).all()
        for impl in ("tiled", "auto"):
            other = ModelConfig.tiny(dtype=jnp.float32, init_std=0.08, grouped_matmul=impl)
            got, aux_o = init_model(other, seed=3)(tokens)
            np.testing.assert_array_equal(aux_o["topk_idx"], aux["topk_idx"])
            assert_logits_agree(model, got, ref, tokens.shape[1])
    with pytest.raises(ValueError, match="grouped_matmul"):
        ModelConfig.tiny(grouped_matmul="dense")
