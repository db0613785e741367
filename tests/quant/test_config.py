"""QuantConfig: guided-layer specs, the standard sites and recipes, formats per site, site keys."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.models import SiteName
from trace_jax.quant import (
    LAYER_FRACTIONS,
    QUANT_RECIPES,
    SITES,
    QuantConfig,
    SiteKind,
    parse_layer_spec,
    parse_site_key,
    quant_recipe,
    resolve_layers,
    site_key,
    site_kind,
)
from trace_jax.quant.config import ACTIVATION_SITES, GUIDABLE_SITES, KV_SITES, WEIGHT_SITES


def _old_deeper_layers(n_layers: int, fraction: float) -> tuple[int, ...]:
    """The float formula the fraction specs replace (the deepest `fraction` of the layers)."""
    start = math.floor(n_layers * (1.0 - fraction) + 1e-9)
    return tuple(range(min(start, n_layers - 1), n_layers))


FRACTIONS = {"all": 1.0, "half": 0.5, "quarter": 0.25, "eighth": 0.125}


def test_fraction_specs_keep_the_old_layers_for_every_depth():
    assert set(LAYER_FRACTIONS) == set(FRACTIONS)
    for n in range(1, 65):
        assert QuantConfig().layers_guided(n) == tuple(range(n // 2, n)), n  # old default
        for name, fraction in FRACTIONS.items():
            expected = _old_deeper_layers(n, fraction)
            assert resolve_layers(name, n) == expected, (name, n)
            assert QuantConfig(guided_layers=name).layers_guided(n) == expected, (name, n)


def test_explicit_layer_specs():
    assert resolve_layers("half", 8) == (4, 5, 6, 7)
    assert resolve_layers("eighth", 4) == (3,)  # at least one layer
    assert resolve_layers("3,0", 4) == resolve_layers(" 0, 3", 4) == (0, 3)
    assert resolve_layers([3, 0, 3], 4) == resolve_layers(np.array([0, 3]), 4) == (0, 3)
    assert resolve_layers((), 4) == ()
    assert parse_layer_spec(" quarter ") == "quarter"
    assert parse_layer_spec("2,1") == (1, 2)
    # a comma list and its ints make equal (and equally hashed) configs
    a, b = QuantConfig(guided_layers="1,0"), QuantConfig(guided_layers=[0, 1])
    assert a == b and hash(a) == hash(b) and a.guided_layers == (0, 1)


@pytest.mark.parametrize(
    ("spec", "n_layers", "match"),
    [
        ("0,4", 4, r"guided layers \[4\] out of range for a 4-layer model \(expected 0..3\)"),
        ((1, 9), 4, r"\[9\] out of range"),
        ("deep", 4, r"one of \['all', 'half', 'quarter', 'eighth'\].*got 'deep'"),
        ("", 4, "comma list"),
        ("-1,2", 4, r"must be >= 0; got \[-1\]"),
        ((0.5,), 4, "must be ints"),
        ((True,), 4, "must be ints"),
        (None, 4, "got None"),
        (0.5, 4, "got 0.5"),
        ("half", 0, "n_layers must be an int >= 1; got 0"),
    ],
)
def test_bad_layer_specs_raise(spec, n_layers, match):
    with pytest.raises(ValueError, match=match):
        resolve_layers(spec, n_layers)


def test_quant_config_checks_its_guided_layers():
    with pytest.raises(ValueError, match="comma list"):
        QuantConfig(guided_layers="deeper")
    with pytest.raises(ValueError, match="out of range"):
        QuantConfig(guided_layers=(5,)).layers_guided(4)


def test_standard_sites_are_the_models_sites():
    assert set(SITES) == {s.value for s in SiteName}
    assert WEIGHT_SITES == ("w_gate", "w_up", "w_down")
    assert ACTIVATION_SITES == ("expert_in", "expert_mid")
    assert KV_SITES == ("k", "v")
    assert GUIDABLE_SITES == ("expert_in", "expert_mid", "k", "v")
    assert "w_up" in WEIGHT_SITES and "k" not in WEIGHT_SITES and 3 not in WEIGHT_SITES
    assert site_kind("expert_mid") is SiteKind.ACTIVATION
    with pytest.raises(ValueError, match="unknown quantization site 'router'"):
        site_kind("router")


def test_standard_recipes_and_formats_per_site():
    formats = {
        "nvfp4": ("nvfp4", "nvfp4", "nvfp4"),
        "mxfp4_w4a4": ("mxfp4", "mxfp4", "mxfp4"),
        "mxfp4_w4a8": ("mxfp4", "mxfp8", "mxfp4"),
    }
    assert set(QUANT_RECIPES) == set(formats)
    for name, (w, a, kv) in formats.items():
        q = quant_recipe(name, guided_layers="all")
        assert (q.weight_format, q.activation_format, q.kv_format) == (w, a, kv)
        assert q.guided_layers == "all"
        assert q == getattr(QuantConfig, name)(guided_layers="all")
        for site in ("w_gate", "w_up", "w_down"):
            assert q.format_for(site) is fp4.get_format(w)
        assert q.format_for("expert_mid") is fp4.get_format(a)
        assert q.format_for("v") is fp4.get_format(kv)
    assert QuantConfig() == QuantConfig.nvfp4()
    q = QuantConfig.mxfp4_w4a8(kv_format=None)
    assert q.format_for("k") is None
    assert q.guided_keys(2) == ("1/expert_in", "1/expert_mid")
    assert q.all_keys(2) == ("0/expert_in", "0/expert_mid", "1/expert_in", "1/expert_mid")
    assert QuantConfig.bf16().guided_keys(4) == ()
    with pytest.raises(ValueError, match=r"unknown FP4 recipe 'fp8'; expected one of \['mxfp4_"):
        quant_recipe("fp8")
    with pytest.raises(ValueError, match="unknown quantization site"):
        q.format_for("router")
    with pytest.raises(ValueError, match="weights are FP4"):
        QuantConfig(weight_format="mxfp8")


def test_site_keys_round_trip():
    assert site_key(12, "expert_mid") == "12/expert_mid"
    assert parse_site_key(site_key(12, "expert_mid")) == (12, "expert_mid")
    for bad in ("expert_in", "x/k", "3/", "/k", 3):
        with pytest.raises(ValueError, match="a site key is '<layer>/<name>'"):
            parse_site_key(bad)
