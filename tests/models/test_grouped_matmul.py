"""The tiled grouped matmul against `jax.lax.ragged_dot` and a float64 numpy reference: values
and gradients, ragged groups with empty ones, rows past the groups, bad shapes; and the model
with `grouped_matmul="tiled"` against the default."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.models import ModelConfig, init_model
from trace_jax.models.grouped_matmul import default_tile, grouped_dot, tiled_ragged_dot


def _numpy_ragged(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for e, g in enumerate(sizes):
        out[start : start + g] = lhs[start : start + g].astype(np.float64) @ rhs[e]
        start += g
    return out


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
    got = np.asarray(tiled_ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), gs, tile=tile))
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.lax.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), gs))
    np.testing.assert_allclose(got, _numpy_ragged(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
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
    for g, r in zip(tiled, ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(tiled[1][1]).max()) == 0.0  # the empty group gets no gradient


def test_bad_shapes_and_default_tile():
    with pytest.raises(ValueError, match="do not fit"):
        tiled_ragged_dot(jnp.zeros((4, 3)), jnp.zeros((2, 5, 2)), jnp.zeros((2,), jnp.int32))
    assert default_tile(98304, 32) == 128 and default_tile(64, 32) == 8 and default_tile(40, 4) == 8
    assert default_tile(1000, 8) == 64
    with pytest.raises(ValueError):
        grouped_dot(jnp.zeros((4, 3)), jnp.zeros((2, 3, 2)), jnp.zeros((2,), jnp.int32), "dense")


def test_auto_tiles_only_many_rows_per_group(monkeypatch):
    from trace_jax.models import grouped_matmul as gm

    assert gm.resolve("auto", 128 * 32, 32) is gm.GroupedMatmul.TILED  # training / prefill
    assert gm.resolve("auto", 128 * 32 - 1, 32) is gm.GroupedMatmul.RAGGED_DOT  # decode
    assert gm.resolve("tiled", 4, 32) is gm.GroupedMatmul.TILED  # explicit choices stand
    assert gm.resolve("ragged_dot", 10**6, 2) is gm.GroupedMatmul.RAGGED_DOT
    # grouped_dot follows the resolution: each path is taken where resolve says.
    calls = []
    monkeypatch.setattr(gm, "tiled_ragged_dot", lambda *a, **k: calls.append("tiled") or a[0])
    monkeypatch.setattr(gm.jax.lax, "ragged_dot", lambda *a, **k: calls.append("ragged") or a[0])
    sizes = jnp.array([3, 5], jnp.int32)
    gm.grouped_dot(jnp.ones((256, 4)), jnp.ones((2, 4, 4)), sizes, "auto")
    gm.grouped_dot(jnp.ones((255, 4)), jnp.ones((2, 4, 4)), sizes, "auto")
    assert calls == ["tiled", "ragged"]


def test_model_with_tiled_grouped_matmul_matches_ragged_dot():
    cfg = ModelConfig.tiny(dtype=jnp.float32, init_std=0.08)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 1, cfg.vocab_size, jnp.int32)
    with jax.default_matmul_precision("highest"):
        ref, _ = init_model(cfg, seed=3)(tokens)
        for impl in ("tiled", "auto"):
            other = ModelConfig.tiny(dtype=jnp.float32, init_std=0.08, grouped_matmul=impl)
            got, _ = init_model(other, seed=3)(tokens)
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="grouped_matmul"):
        ModelConfig.tiny(grouped_matmul="dense")
