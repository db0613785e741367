"""FP4 at the model's sites: formats per site, capture (rollout), guidance (trainer)."""

from trace_jax.quant.config import QuantConfig, SiteMode
from trace_jax.quant.sites import QuantSites, align_expert_guidance, site_key

__all__ = ["QuantConfig", "QuantSites", "SiteMode", "align_expert_guidance", "site_key"]
