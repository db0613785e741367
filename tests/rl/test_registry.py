"""The open extension points: block formats, quantization sites, FP4 recipes and methods, each
extended from this file alone and used through the library's ordinary entry points."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.fp4 import BlockFormat, ElementType, GuidanceMode, ScaleType
from trace_jax.quant import (
    QUANT_RECIPES,
    SITES,
    QuantConfig,
    QuantSites,
    SiteMode,
    quant_recipe,
    register_recipe,
    register_site,
)
from trace_jax.quant.config import ACTIVATION_SITES, GUIDABLE_SITES, WEIGHT_SITES
from trace_jax.rl import LOSSES, METHODS, GRPOConfig, Method, get_method, register_method


@pytest.fixture
def registries():
    """Restores every registry after the test, so other tests see the standard ones."""
    saved = [(r, dict(r)) for r in (fp4.FORMATS, SITES, QUANT_RECIPES, METHODS)]
    yield
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)


def _keys(layers, sites):
    return tuple(f"{layer}/{s}" for layer in layers for s in sites)


def test_a_registered_method_resolves_through_get_method(registries):
    toy = register_method(
        Method(
            name="toy_guided_tbpo",
            description="FP4 RTN rollout, guided trainer on layers 0 and 2, TBPO",
            rollout_mode="rtn",
            trainer_mode="guided",
            loss="tbpo",
            guidance="compact",
            guided_layers="2,0",
        )
    )
    assert get_method("toy_guided_tbpo") is toy and toy.guided_layers == (0, 2)
    s = get_method("toy_guided_tbpo").setup("mxfp4_w4a8", 4)
    assert s.method == "toy_guided_tbpo" and s.fmt == "mxfp4_w4a8" and s.loss == "tbpo"
    assert s.rollout_mode is SiteMode.RTN and s.trainer_mode is SiteMode.GUIDED
    assert s.capture_mode is GuidanceMode.COMPACT
    expected = QuantConfig(
        weight_format="mxfp4",
        activation_format="mxfp8",
        kv_format="mxfp4",
        guided_layers=(0, 2),
        guidance_mode="compact",
    )
    assert s.rollout_qcfg == s.trainer_qcfg == expected
    assert s.capture == _keys((0, 2), ("expert_in", "expert_mid", "k", "v"))
    loss_fn = toy.loss_fn(GRPOConfig(tbpo_band=(0.5, 2.0)))
    assert loss_fn.func is LOSSES["tbpo"] and loss_fn.keywords["band"] == (0.5, 2.0)
    s = toy.setup("nvfp4", 8, guided_layers="quarter")
    assert s.capture == _keys((6, 7), ("expert_in", "expert_mid", "k", "v"))


def test_a_registered_recipe_and_format_serve_methods_and_the_quantizer(registries):
    mx16 = fp4.register_format(
        BlockFormat("mxfp4_b16", ElementType.E2M1, 16, ScaleType.E8M0, has_global_scale=False)
    )
    assert fp4.get_format("MXFP4_B16") is mx16
    register_recipe(
        "toy_w4a4_b16",
        functools.partial(
            QuantConfig, weight_format="nvfp4", activation_format="mxfp4_b16", kv_format=None
        ),
    )
    q = quant_recipe("toy_w4a4_b16")
    assert q.format_for("expert_in") is mx16 and q.format_for("w_down") is fp4.NVFP4
    assert q.format_for("k") is None
    s = get_method("trace").setup("toy_w4a4_b16", 2)
    assert s.capture == ("1/expert_in", "1/expert_mid")  # no KV sites: the cache stays bf16
    assert s.trainer_qcfg.activation_format == "mxfp4_b16"

    # The quantizer honours the format's block size: MXFP4 over 16 elements equals MXFP4 over 32
    # where the other 16 are zeros (zeros leave the block max, hence the scale, unchanged).
    x = jax.random.normal(jax.random.key(0), (3, 64))
    padded = np.concatenate([np.asarray(x).reshape(3, 4, 16), np.zeros((3, 4, 16))], axis=-1)
    reference = fp4.fake_quant(padded.reshape(3, 128).astype(np.float32), fp4.MXFP4)
    reference = np.asarray(reference).reshape(3, 4, 32)[..., :16].reshape(3, 64)
    y = QuantSites(q, 2, SiteMode.RTN)(x, name="expert_in", layer=0)
    np.testing.assert_array_equal(y, reference)
    assert not np.array_equal(y, fp4.fake_quant(x, fp4.MXFP4))  # block 32 would differ


def test_a_registered_site_is_quantized_and_guided_by_its_kind(registries):
    register_site("attn_out", "activation")
    register_site("w_router", "weight")
    assert "attn_out" in ACTIVATION_SITES and "attn_out" in GUIDABLE_SITES
    assert "w_router" in WEIGHT_SITES and "w_router" not in GUIDABLE_SITES
    q = QuantConfig.mxfp4_w4a8()
    assert q.format_for("attn_out") is fp4.MXFP8 and q.format_for("w_router") is fp4.MXFP4
    assert q.guided_keys(2) == _keys((1,), ("expert_in", "expert_mid", "k", "v", "attn_out"))
    assert get_method("trace").setup("mxfp4_w4a8", 2).capture == q.guided_keys(2)

    x = jax.random.normal(jax.random.key(1), (2, 3, 64))
    w = jax.random.normal(jax.random.key(2), (4, 8, 64))
    sites = QuantSites(q, 2, SiteMode.RTN, capture=["1/attn_out"])
    np.testing.assert_array_equal(sites(x, name="attn_out", layer=1), fp4.fake_quant(x, fp4.MXFP8))
    assert sites.captured["1/attn_out"].fmt is fp4.MXFP8
    # a weight site: one global scale per matrix, never captured
    np.testing.assert_array_equal(
        sites(w, name="w_router", layer=1), fp4.fake_quant(w, fp4.MXFP4, global_axes=(-2, -1))
    )


def test_duplicates_raise_unless_replaced(registries):
    trace = get_method("trace")
    with pytest.raises(ValueError, match="method 'trace' is already registered"):
        register_method(trace)
    quarter = dataclasses.replace(trace, guided_layers="quarter")
    assert register_method(quarter, replace=True) is get_method("trace")
    assert get_method("trace").setup("nvfp4", 8).capture[0].startswith("6/")

    with pytest.raises(ValueError, match="FP4 recipe 'nvfp4' is already registered"):
        register_recipe("nvfp4", QUANT_RECIPES["mxfp4_w4a4"])
    register_recipe("nvfp4", QUANT_RECIPES["mxfp4_w4a4"], replace=True)
    assert QuantConfig.nvfp4().weight_format == "mxfp4"

    with pytest.raises(ValueError, match=r"site 'k' is already registered \(as 'kv'\)"):
        register_site("k", "activation")
    register_site("k", "activation", replace=True)
    assert "k" in ACTIVATION_SITES

    with pytest.raises(ValueError, match="block format 'nvfp4' is already registered"):
        fp4.register_format(fp4.NVFP4)


def test_bad_registrations_raise(registries):
    with pytest.raises(TypeError, match="takes a Method"):
        register_method("trace")
    with pytest.raises(TypeError, match="must return a QuantConfig"):
        register_recipe("toy", dict)
    with pytest.raises(ValueError, match="weights are FP4"):
        register_recipe("toy", functools.partial(QuantConfig, weight_format="mxfp8"))
    assert "toy" not in QUANT_RECIPES
    with pytest.raises(ValueError, match=r"site kind must be one of \['weight'"):
        register_site("router", "gate")
    with pytest.raises(ValueError, match="without '/'"):
        register_site("1/k", "kv")
    with pytest.raises(ValueError, match="lower case"):
        fp4.register_format(BlockFormat("MX4", ElementType.E2M1, 32, ScaleType.E8M0, False))
    with pytest.raises(TypeError, match="takes a BlockFormat"):
        fp4.register_format("mxfp4")
