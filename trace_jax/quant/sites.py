"""`QuantSites`: the model's quantization hook for one forward call, rollout or trainer side.

The model calls `sites(x, name=..., layer=...)` at every FP4 site (see trace_jax.models.config).
One object serves every role, so rollout and trainer run the same quantizer (`trace_jax.fp4`):

* rollout: `SiteMode.RTN`, `capture=` the guided site keys -> `captured[key]` holds the `QTensor`
  the rollout really used (its codes and scales become the guidance);
* trainer: `SiteMode.RTN` (vanilla FP4 QAT) or `SiteMode.GUIDED` with the rollout's guidance;
  `reference=` full rollout codes turn on per-site mismatch statistics (`stats[key]`).

Guidance arrays are aligned with the trainer's tensors: `[B, T, ...]` in the same sequence layout,
and for "expert_mid" `[B, T, K, F]` in the rollout's slot order, re-aligned here to the trainer's
slots by expert id (`align_expert_guidance`); a trainer slot whose expert the rollout did not use
has no guidance and falls back to RTN, and is counted in `coverage`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

from kernels_pallas.common import Implementation
from kernels_pallas.fp4_quantize import QuantizedCapture, fp4_quantize
from trace_jax import fp4
from trace_jax.fp4 import Guidance, GuidanceMode, QTensor, make_guidance
from trace_jax.models.backends import kernel_order
from trace_jax.quant.config import (
    ACTIVATION_SITES,
    WEIGHT_SITES,
    QuantConfig,
    SiteMode,
    site_key,
)


def align_expert_guidance(
    g: Guidance, rollout_experts: jax.Array, train_experts: jax.Array
) -> Guidance:
    """Re-orders slot-indexed guidance `[B, T, K, ...]` from the rollout's slots to the trainer's.

    Args:
      g: guidance whose rows are `[B, T, K]` in the rollout's slot order.
      rollout_experts, train_experts: int `[B, T, K]` expert ids per slot on each side.

    Returns:
      Guidance in the trainer's slot order; `mask` is False where the trainer's expert was not
      among the rollout's (and where `g.mask` was False).
    """
    match = rollout_experts[..., None, :] == train_experts[..., :, None]  # [B, T, K_tr, K_ro]
    has = jnp.any(match, axis=-1)
    src = jnp.argmax(match, axis=-1)  # rollout slot of each trainer slot

    def take(a):
        if a is None:
            return None
        idx = src.reshape(*src.shape, *([1] * (a.ndim - src.ndim)))
        return jnp.take_along_axis(a, idx, axis=src.ndim - 1)

    mask = has if g.mask is None else has & take(g.mask)
    return Guidance(take(g.payload), take(g.scales), take(g.global_scale), mask, g.fmt, g.mode)


def _rows_mask(valid: jax.Array | None, rows_shape: tuple[int, ...]) -> jax.Array | None:
    """Broadcasts a `[B, T]` validity mask to a site's row shape `[B, T, ...]`."""
    if valid is None:
        return None
    extra = len(rows_shape) - valid.ndim
    return jnp.broadcast_to(valid.reshape(*valid.shape, *([1] * extra)), rows_shape)


class QuantSites:
    """A `QuantSite` for one forward call; collects captures and statistics as it goes.

    Args:
      qcfg: the FP4 recipe.
      n_layers: model depth (to resolve the default guided layers).
      mode: OFF, RTN or GUIDED.
      guidance: site key -> rollout `Guidance` (GUIDED mode; required for every guided key).
      rollout_experts: int `[L, B, T, K]` rollout expert choices (to align "expert_mid").
      reference: site key -> full rollout `Guidance`, for code-mismatch statistics.
      capture: site keys whose `QTensor` to keep in `captured`.
      valid: bool `[B, T]`, real (non-padding) positions; only these count and get guidance.
      differentiable: use the straight-through `fake_quant` (trainer); else plain
        quantize/dequantize (rollout). Both give the same values.
      implementation: the forward call's kernels, "xla" or "pallas" (the model reads it here,
        `trace_jax.models.site_implementation`). "pallas" is rollout only: FP4 activation and KV
        sites quantize with the fused quantize + capture op (identical codes; `kernel_order`),
        the packed KV cache is read by the FP4 decode-attention op; "xla": `trace_jax.fp4`.
      residual_fraction: rollout only (QUADS): per token, the fraction of activation channels
        with the largest quantization error whose residual gets a second FP4 pass that is added
        back (residual activation compensation). 0 disables it.
      packed_experts: rollout with implementation="pallas": layer -> `PackedExperts` (see
        `trace_jax.models.moe.pack_experts`), the expert weights quantized and packed once per
        policy version; those layers run the Pallas FP4 MoE matmul on them instead of
        fake-quantizing the weights every step.
    """

    def __init__(
        self,
        qcfg: QuantConfig,
        n_layers: int,
        mode: str | SiteMode,
        *,
        guidance: Mapping[str, Guidance] | None = None,
        rollout_experts: jax.Array | None = None,
        reference: Mapping[str, Guidance] | None = None,
        capture: Iterable[str] = (),
        valid: jax.Array | None = None,
        differentiable: bool = True,
        implementation: str | Implementation = "xla",
        residual_fraction: float = 0.0,
        packed_experts: Mapping[int, object] | None = None,
    ):
        self.qcfg = qcfg
        self.mode = SiteMode(mode)
        self.guided_keys = frozenset(qcfg.guided_keys(n_layers))
        self.guidance = dict(guidance or {})
        self.rollout_experts = rollout_experts
        self.reference = dict(reference or {})
        self.capture = frozenset(capture)
        self.valid = valid
        self.differentiable = differentiable
        if implementation not in [i.value for i in Implementation]:
            raise ValueError(f"implementation must be 'xla' or 'pallas', got {implementation!r}")
        self._implementation = Implementation(implementation)
        if self._implementation is Implementation.PALLAS and differentiable:
            raise ValueError("the Pallas kernels serve the rollout (differentiable=False)")
        if not 0.0 <= residual_fraction <= 1.0:
            raise ValueError(f"residual_fraction must be in [0, 1], got {residual_fraction}")
        if residual_fraction and differentiable:
            raise ValueError("residual compensation is a rollout feature (differentiable=False)")
        self.residual_fraction = residual_fraction
        pallas = self._implementation is Implementation.PALLAS
        if packed_experts and (not pallas or residual_fraction):
            raise ValueError(
                "packed_experts feed the Pallas FP4 MoE kernel: implementation='pallas' and no "
                "residual compensation"
            )
        self.packed_experts = dict(packed_experts or {})
        self.captured: dict[str, QTensor] = {}
        self._fused: dict[str, QuantizedCapture] = {}  # key -> the fused pass's outputs
        self.stats: dict[str, dict[str, jax.Array]] = {}
        self.coverage: dict[str, dict[str, jax.Array]] = {}
        if self.mode is SiteMode.GUIDED:
            missing = sorted(self.guided_keys - set(self.guidance))
            if missing:
                raise ValueError(f"guided mode: no rollout guidance for sites {missing}")

    def records(self) -> dict[str, dict]:
        """What a forward call fills, by site key (`trace_jax.models.site_records`)."""
        return {
            "captured": self.captured,
            "fused": self._fused,
            "stats": self.stats,
            "coverage": self.coverage,
        }

    @property
    def records_per_row(self) -> bool:
        """Whether every record a forward call fills is split by batch rows (captures), so a
        computation on each device's rows can hand its own out; False where some reduce over
        rows: GUIDED mode's coverage counts, `reference=` mismatch statistics."""
        return self.mode is not SiteMode.GUIDED and not self.reference

    @property
    def implementation(self) -> Implementation:
        """The forward call's kernels (fixed at construction): XLA or PALLAS."""
        return self._implementation

    def _aligned(self, g: Guidance, name: str, layer: int, experts) -> Guidance:
        if name != "expert_mid":
            return g
        if experts is None or self.rollout_experts is None:
            raise ValueError(
                "expert_mid guidance needs the rollout's and the trainer's expert choices"
            )
        return align_expert_guidance(g, self.rollout_experts[layer], experts)

    def __call__(self, x: jax.Array, *, name: str, layer: int, experts=None) -> jax.Array:
        return self._site(x, name=name, layer=layer, experts=experts, want_q=False)[0]

    def quantized(
        self, x: jax.Array, *, name: str, layer: int, experts=None
    ) -> tuple[jax.Array, QTensor | None]:
        """The site's value and its `QTensor` (None where the site does not quantize): what a
        kernel consuming quantized operands (the FP4 MoE matmul) needs. Same captures and
        statistics as calling the site."""
        return self._site(x, name=name, layer=layer, experts=experts, want_q=True)

    def packed_experts_for(self, layer: int):
        """The layer's packed FP4 expert weights (rollout with the Pallas MoE kernel), or None."""
        return self.packed_experts.get(layer)

    def _site(self, x, *, name, layer, experts, want_q):
        fmt = self.qcfg.format_for(name)
        if self.mode is SiteMode.OFF or fmt is None:
            return x, None
        if name in WEIGHT_SITES:  # identical on both sides: RTN, one global scale per matrix
            if self.qcfg.weights_prequantized:
                return x, None
            return fp4.fake_quant(x, fmt, global_axes=(-2, -1)), None

        key = site_key(layer, name)
        valid = _rows_mask(self.valid, x.shape[:-1])
        g = None
        if self.mode is SiteMode.GUIDED and key in self.guided_keys:
            g = self._aligned(self.guidance[key], name, layer, experts)
            mask = g.mask if valid is None else (valid if g.mask is None else g.mask & valid)
            g = Guidance(g.payload, g.scales, g.global_scale, mask, g.fmt, g.mode)
            rows = jnp.ones(x.shape[:-1], bool) if valid is None else valid
            guided_rows = rows if g.mask is None else g.mask
            self.coverage[key] = {
                "rows": jnp.sum(rows, dtype=jnp.int32),
                "guided_rows": jnp.sum(guided_rows & rows, dtype=jnp.int32),
            }
        rounding = "rtn" if g is None else "guided"

        q = None
        if self.differentiable:
            y = fp4.fake_quant(x, fmt, rounding=rounding, guidance=g)
        elif self._implementation is Implementation.PALLAS and fmt.is_fp4 and g is None:
            fused = fp4_quantize(x, fmt, implementation=kernel_order(self._implementation))
            if key in self.capture:
                self._fused[key] = fused
            q = fused.qtensor()
            y = fp4.dequantize(q, x.dtype)
        else:
            y = fp4.dequantize(fp4.quantize(x, fmt, rounding=rounding, guidance=g), x.dtype)

        if self.residual_fraction and name in ACTIVATION_SITES:
            y = self._compensate(x, y, fmt)

        if want_q or key in self.capture or key in self.reference:
            if q is None:  # same inputs as the forward value: XLA computes it once
                q = fp4.quantize(jax.lax.stop_gradient(x), fmt, rounding=rounding, guidance=g)
            if key in self.capture:
                self.captured[key] = q
            if key in self.reference:
                ref = self._aligned(self.reference[key], name, layer, experts)
                where = valid
                if ref.mask is not None:
                    where = ref.mask if where is None else where & ref.mask
                self.stats[key] = fp4.mismatch_stats(
                    q.codes,
                    ref.rollout_codes(),
                    fmt,
                    where=None if where is None else where[..., None],
                )
        return y, q

    def captured_guidance(self, mode: str | GuidanceMode = "compact") -> dict[str, Guidance]:
        """The captured sites as guidance (`captured` keys). Sites quantized by the fused Pallas
        kernel hand over its own outputs (compact bits, packed codes): capture adds no pass."""
        return {
            key: self._fused[key].guidance(mode) if key in self._fused else make_guidance(q, mode)
            for key, q in self.captured.items()
        }

    def _compensate(self, x: jax.Array, y: jax.Array, fmt) -> jax.Array:
        """QUADS: adds a second FP4 pass over the residual of each row's worst channels."""
        residual = x.astype(jnp.float32) - y.astype(jnp.float32)
        n = x.shape[-1]
        k = max(1, round(self.residual_fraction * n))
        err = jnp.abs(residual)
        kth = jax.lax.top_k(err, k)[0][..., -1:]
        picked = jnp.where(err >= kth, residual, 0.0)
        second = fp4.dequantize(fp4.quantize(picked, fmt), jnp.float32)
        return (y.astype(jnp.float32) + second).astype(x.dtype)
