"""`QuantConfig`: the FP4 recipe of a run (SPEC 3): formats per site and the guided layers."""

from __future__ import annotations

import dataclasses
import enum

from trace_jax import fp4
from trace_jax.fp4 import BlockFormat, GuidanceMode

WEIGHT_SITES = ("w_gate", "w_up", "w_down")
ACTIVATION_SITES = ("expert_in", "expert_mid")
KV_SITES = ("k", "v")
# Sites whose rollout decisions can be captured and replayed (weights are identical on both sides).
GUIDABLE_SITES = (*ACTIVATION_SITES, *KV_SITES)


class SiteMode(enum.StrEnum):
    """How a forward pass treats the quantization sites."""

    OFF = "off"  # bf16 everywhere (the BF16 rollout and trainer)
    RTN = "rtn"  # FP4 with own scales, round to nearest (the FP4 rollout; vanilla FP4 QAT)
    GUIDED = "guided"  # trainer: guided layers follow the rollout's guidance, others RTN


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Formats of the routed-expert weights and activations and of the KV cache.

    Attributes:
      weight_format: routed expert weights (None: bf16). NVFP4 weights get one global scale per
        expert matrix.
      activation_format: expert input and down-projection input ("mxfp8" gives W4A8).
      kv_format: K and V per token and head (None: bf16 KV cache).
      guided_layers: layers whose activation/KV sites carry guidance; None = the deeper half.
      guidance_mode: "compact" (1 bit/element + scales) or "full" (codes + scales).
      weights_prequantized: the expert weights already hold FP4 values (post-training
        quantization, `trace_jax.quant.ptq`): weight sites pass them through unchanged.
    """

    weight_format: str | None = "nvfp4"
    activation_format: str | None = "nvfp4"
    kv_format: str | None = "nvfp4"
    guided_layers: tuple[int, ...] | None = None
    guidance_mode: GuidanceMode = GuidanceMode.COMPACT
    weights_prequantized: bool = False

    def __post_init__(self):
        for name in ("weight_format", "activation_format", "kv_format"):
            value = getattr(self, name)
            if value is not None:
                fp4.get_format(value)  # raises on an unknown format
        if self.weight_format is not None and not fp4.get_format(self.weight_format).is_fp4:
            raise ValueError(f"weights are FP4 here; got weight_format={self.weight_format!r}")
        object.__setattr__(self, "guidance_mode", GuidanceMode(self.guidance_mode))
        if self.guided_layers is not None:
            object.__setattr__(self, "guided_layers", tuple(sorted(set(self.guided_layers))))

    @classmethod
    def nvfp4(cls, **overrides) -> QuantConfig:
        """NVFP4 weights, activations and KV cache (the paper's main setting)."""
        return cls(**overrides)

    @classmethod
    def mxfp4_w4a4(cls, **overrides) -> QuantConfig:
        return cls(
            **{"weight_format": "mxfp4", "activation_format": "mxfp4", "kv_format": "mxfp4"}
            | overrides
        )

    @classmethod
    def mxfp4_w4a8(cls, **overrides) -> QuantConfig:
        return cls(
            **{"weight_format": "mxfp4", "activation_format": "mxfp8", "kv_format": "mxfp4"}
            | overrides
        )

    @classmethod
    def bf16(cls) -> QuantConfig:
        return cls(weight_format=None, activation_format=None, kv_format=None)

    def format_for(self, site: str) -> BlockFormat | None:
        """The format of a site name (None: that site stays bf16)."""
        if site in WEIGHT_SITES:
            name = self.weight_format
        elif site in ACTIVATION_SITES:
            name = self.activation_format
        elif site in KV_SITES:
            name = self.kv_format
        else:
            raise ValueError(f"unknown quantization site {site!r}")
        return None if name is None else fp4.get_format(name)

    def layers_guided(self, n_layers: int) -> tuple[int, ...]:
        """The guided layers of an `n_layers` model (default: the deeper half)."""
        if self.guided_layers is None:
            return tuple(range(n_layers // 2, n_layers))
        bad = [i for i in self.guided_layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"guided_layers {bad} out of range for a {n_layers}-layer model")
        return self.guided_layers

    def guided_keys(self, n_layers: int) -> tuple[str, ...]:
        """Site keys ("layer/name") that carry guidance in this recipe."""
        from trace_jax.quant.sites import site_key

        return tuple(
            site_key(layer, s)
            for layer in self.layers_guided(n_layers)
            for s in GUIDABLE_SITES
            if self.format_for(s) is not None
        )

    def all_keys(self, n_layers: int) -> tuple[str, ...]:
        """Every quantized guidable site key, all layers (for diagnostics)."""
        from trace_jax.quant.sites import site_key

        return tuple(
            site_key(layer, s)
            for layer in range(n_layers)
            for s in GUIDABLE_SITES
            if self.format_for(s) is not None
        )
