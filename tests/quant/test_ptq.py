"""PTQ recipes (Table 7 baselines) against a float64 numpy brute force over the same candidates."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from tests import tiny
from trace_jax import fp4
from trace_jax.quant import ptq

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _rtn_e2m1(z):
    """Nearest E2M1 magnitude (ties to the even grid index), sign kept; |z| clipped at 6."""
    a = np.minimum(np.abs(z), 6.0)
    d = np.abs(a[..., None] - GRID)
    best = d.min(-1, keepdims=True)
    ties = np.isclose(d, best, rtol=0, atol=0)
    idx = np.where(ties.sum(-1) > 1, np.argmax(ties & (np.arange(8) % 2 == 0), -1), d.argmin(-1))
    return np.sign(z) * GRID[idx]


def _e4m3(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _reference(w, h, candidate_scales, g):
    """Per 16-block, the candidate scale with the least h-weighted error; dequantized values."""
    wb = w.reshape(*w.shape[:-1], -1, 16)
    hb = np.broadcast_to(h, w.shape).reshape(wb.shape)
    best, best_err = None, None
    for s in candidate_scales:  # [..., NB] float64 block scales
        deq = _rtn_e2m1(wb / (s[..., None] * g)) * s[..., None] * g
        err = ((deq - wb) ** 2 * hb).sum(-1)
        if best is None:
            best, best_err = deq, err
        else:
            better = err < best_err
            best = np.where(better[..., None], deq, best)
            best_err = np.where(better, err, best_err)
    return best.reshape(w.shape)


def _weights(seed, shape=(6, 64)):
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, shape) * np.exp(rng.normal(size=(*shape[:-1], 1)))
    return w.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_4over6_matches_brute_force(seed):
    w = _weights(seed)
    q = ptq.quantize_4over6(w)
    w64 = w.astype(np.float64)
    amax_b = np.abs(w64.reshape(6, -1, 16)).max(-1)
    g = (np.abs(w).max(-1, keepdims=True).astype(np.float64) / (6 * 256))[..., None]
    cands = [np.maximum(_e4m3(amax_b / (k * g[..., 0])), 2.0**-9) for k in (6.0, 4.0)]
    ref = _reference(w64, 1.0, cands, g)
    np.testing.assert_allclose(np.asarray(fp4.dequantize(q)), ref, rtol=2e-6, atol=1e-30)
    # Never worse than mapping every block max to 6 under the same global scale.
    six_only = _reference(w64, 1.0, cands[:1], g)
    assert ((ref - w64) ** 2).sum() <= ((six_only - w64) ** 2).sum()


@pytest.mark.parametrize("seed", [0, 3])
def test_hscale_matches_brute_force_and_beats_vanilla(seed):
    w = _weights(seed, (4, 3, 64))
    h = np.random.default_rng(seed + 10).exponential(size=64).astype(np.float32) ** 2
    q = ptq.quantize_hscale(w, h, window=2, global_axes=(-2, -1))
    vanilla = fp4.quantize(w, fp4.NVFP4, global_axes=(-2, -1))
    base_bits = np.asarray(jax.lax.bitcast_convert_type(vanilla.scales, np.uint8)).astype(int)
    g = np.asarray(vanilla.global_scale, np.float64)[..., None]  # [G, 1, 1, 1] over blocks
    cands = [
        np.clip(base_bits + d, 1, 0x7E)
        .astype(np.uint8)
        .view(ml_dtypes.float8_e4m3fn)
        .astype(np.float64)
        for d in (0, -1, 1, -2, 2)
    ]
    ref = _reference(w.astype(np.float64), h.astype(np.float64), cands, g)
    np.testing.assert_allclose(np.asarray(fp4.dequantize(q)), ref, rtol=2e-6, atol=1e-30)
    assert float(ptq.weighted_error(w, q, h)) <= float(ptq.weighted_error(w, vanilla, h))
    assert float(ptq.weighted_error(w, q, h)) < float(ptq.weighted_error(w, vanilla, h))


def test_recipes_dispatch_and_errors():
    w = _weights(5)
    np.testing.assert_array_equal(
        np.asarray(ptq.quantize_weights(w, "vanilla").codes),
        np.asarray(fp4.quantize(w, fp4.NVFP4).codes),
    )
    with pytest.raises(ValueError, match="needs the calibration"):
        ptq.quantize_weights(w, "hscale")
    with pytest.raises(ValueError, match="recipe must be one of"):
        ptq.quantize_weights(w, "gptq")


def test_model_ptq_vanilla_equals_the_weight_sites_and_hscale_lowers_weighted_error():
    import jax.numpy as jnp
    from flax import nnx

    from trace_jax.models import init_model
    from trace_jax.quant import QuantConfig, QuantSites, SiteMode

    cfg = tiny.model_config(init_std=0.08)
    tokens = jax.random.randint(jax.random.key(0), (3, 10), 1, cfg.vocab_size)
    valid = jnp.arange(10)[None, :] < jnp.array([[10], [7], [4]])
    model = init_model(cfg, seed=1)
    stats = ptq.calibration_stats(model, tokens, valid)
    assert stats[0]["in"].shape == (cfg.n_experts, cfg.d_model)
    assert stats[0]["mid"].shape == (cfg.n_experts, cfg.d_ff_expert)
    # Every valid (token, slot) pair lands on one expert: the "in" totals count each token K times.
    x_total = sum(float(s["in"].sum()) for s in stats.values())
    assert x_total > 0 and np.isfinite(x_total)

    def logits(m, qcfg):
        sites = QuantSites(qcfg, cfg.n_layers, SiteMode.RTN, differentiable=False)
        return m(tokens, mask=valid, site=sites)[0]

    reference = logits(model, QuantConfig.nvfp4())
    vanilla = nnx.clone(model)
    ptq.quantize_model_experts(vanilla, "vanilla")
    np.testing.assert_array_equal(
        logits(vanilla, QuantConfig.nvfp4(weights_prequantized=True)), reference
    )
    for layer, block in enumerate(model.layers):
        w = block.moe.w_down[...].astype(cfg.dtype)
        h = stats[layer]["mid"][:, None, :]
        plain = ptq.quantize_weights(w, "vanilla", global_axes=(-2, -1))
        tuned = ptq.quantize_weights(w, "hscale", h=h, global_axes=(-2, -1))
        assert float(ptq.weighted_error(w, tuned, h)) < float(ptq.weighted_error(w, plain, h))
