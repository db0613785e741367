"""FP4 at the model's sites: formats per site, capture (rollout), guidance (trainer); the
registries of sites and FP4 recipes, and the guided-layer specs."""

from trace_jax.quant.config import (
    LAYER_FRACTIONS,
    QUANT_RECIPES,
    SITES,
    LayerSpec,
    QuantConfig,
    SiteKind,
    SiteMode,
    parse_layer_spec,
    parse_site_key,
    quant_recipe,
    register_recipe,
    register_site,
    resolve_layers,
    site_key,
    site_kind,
)
from trace_jax.quant.sites import QuantSites, align_expert_guidance

__all__ = [
    "LAYER_FRACTIONS",
    "QUANT_RECIPES",
    "SITES",
    "LayerSpec",
    "QuantConfig",
    "QuantSites",
    "SiteKind",
    "SiteMode",
    "align_expert_guidance",
    "parse_layer_spec",
    "parse_site_key",
    "quant_recipe",
    "register_recipe",
    "register_site",
    "resolve_layers",
    "site_key",
    "site_kind",
]
