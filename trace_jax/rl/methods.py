"""The compared methods (SPEC 7) as data: how each one quantizes the rollout and the trainer.

A `Method` is format-free; `Method.setup(fmt, n_layers)` resolves it for one FP4 recipe
("nvfp4", "mxfp4_w4a4", "mxfp4_w4a8") and one model depth into a `MethodSetup`, whose fields
go straight to the rollout (`trace_jax.rollout.generate`: qcfg, mode, capture, capture_mode) and
to the trainer (`trace_jax.train.train_forward`: qcfg, mode; the loss via `loss_fn`).

| name       | rollout                 | trainer                              | loss     |
| ---------- | ----------------------- | ------------------------------------ | -------- |
| bf16       | bf16 (OFF)              | bf16 (OFF)                           | ppo_clip |
| fp4_qat    | FP4 RTN                 | RTN fake quant, all FP4 sites        | ppo_clip |
| qarl       | FP4 RTN                 | RTN fake quant (rollout's W and A)   | tbpo     |
| quads      | W4A4 + residual comp.   | RTN fake quant, expert weights only  | ppo_clip |
| trace      | FP4 RTN, compact capture, deeper half | GUIDED                 | ppo_clip |
| trace_full | FP4 RTN, full capture, all layers     | GUIDED                 | ppo_clip |
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from trace_jax.fp4 import GuidanceMode
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.losses import LOSSES, LossFn

# FP4 recipe name -> QuantConfig preset (`trace_jax.quant.QuantConfig` classmethods).
FORMAT_PRESETS: dict[str, Callable[..., QuantConfig]] = {
    "nvfp4": QuantConfig.nvfp4,
    "mxfp4_w4a4": QuantConfig.mxfp4_w4a4,
    "mxfp4_w4a8": QuantConfig.mxfp4_w4a8,
}

_QCFG_FIELDS = frozenset(f.name for f in dataclasses.fields(QuantConfig))


def quant_preset(fmt: str, **overrides) -> QuantConfig:
    """The QuantConfig preset called `fmt`, with field overrides."""
    if fmt not in FORMAT_PRESETS:
        raise ValueError(f"unknown FP4 recipe {fmt!r}; expected one of {sorted(FORMAT_PRESETS)}")
    return FORMAT_PRESETS[fmt](**overrides)


def deeper_layers(n_layers: int, fraction: float) -> tuple[int, ...]:
    """The deepest `fraction` of `n_layers` layers (0.5: the deeper half, as `QuantConfig`)."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1; got {n_layers}")
    start = math.floor(n_layers * (1.0 - fraction) + 1e-9)
    return tuple(range(min(start, n_layers - 1), n_layers))


LAYER_FRACTIONS = {"all": 1.0, "half": 0.5, "quarter": 0.25, "eighth": 0.125}


def layers_from_spec(spec: str, n_layers: int) -> tuple[int, ...]:
    """Guided layers from a flag/config value: "all" | "half" | "quarter" | "eighth" (the
    deepest fraction, as `deeper_layers`) or a comma-separated list of layer indices."""
    if spec in LAYER_FRACTIONS:
        return deeper_layers(n_layers, LAYER_FRACTIONS[spec])
    try:
        layers = tuple(int(s) for s in spec.split(","))
    except ValueError:
        raise ValueError(
            f"guided layers must be one of {sorted(LAYER_FRACTIONS)} or a comma list of ints, "
            f"got {spec!r}"
        ) from None
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"guided layers {bad} out of range for a {n_layers}-layer model")
    return layers


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodSetup:
    """One method resolved for an FP4 recipe and a model depth.

    rollout_qcfg, rollout_mode: for `generate(qcfg=..., mode=...)`.
    capture, capture_mode: the guided site keys the rollout records, and how ("compact"/"full");
      `capture` is empty for methods without guidance.
    trainer_qcfg, trainer_mode: for `train_forward(qcfg=..., mode=...)`.
    loss: the name of the loss in `trace_jax.rl.losses.LOSSES`.
    rollout_residual_channels: fraction of activation channels whose quantization residual the
      rollout quantizes again (QUADS); 0 elsewhere.
    """

    method: str
    fmt: str
    rollout_qcfg: QuantConfig
    rollout_mode: SiteMode
    capture: tuple[str, ...]
    capture_mode: GuidanceMode
    trainer_qcfg: QuantConfig
    trainer_mode: SiteMode
    loss: str
    rollout_residual_channels: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """How one method quantizes the rollout and the trainer, and which loss it optimizes.

    Attributes:
      name: the registry key.
      description: one line, for logs and tables.
      rollout_mode: SiteMode.OFF (bf16 rollout) or SiteMode.RTN (FP4 rollout).
      trainer_mode: SiteMode.OFF, RTN (fake quant with own scales) or GUIDED (TRACE).
      loss: a key of `LOSSES` ("ppo_clip" or "tbpo").
      guidance: how the rollout records its rounding decisions (None: it records nothing).
      guided_fraction: the deepest fraction of layers with guidance (0.5: the paper's last 20 of
        40 layers; 1.0: all layers).
      trainer_overrides: QuantConfig field overrides for the trainer only, as (field, value) pairs
        (QUADS: activations and KV cache bf16 in the trainer).
      rollout_residual_channels: QUADS' residual activation compensation in the rollout: the
        fraction of the highest-error activation channels whose quantization residual gets a
        second FP4 pass (0: none).
    """

    name: str
    description: str
    rollout_mode: SiteMode
    trainer_mode: SiteMode
    loss: str
    guidance: GuidanceMode | None = None
    guided_fraction: float = 0.5
    trainer_overrides: tuple[tuple[str, Any], ...] = ()
    rollout_residual_channels: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "rollout_mode", SiteMode(self.rollout_mode))
        object.__setattr__(self, "trainer_mode", SiteMode(self.trainer_mode))
        if self.guidance is not None:
            object.__setattr__(self, "guidance", GuidanceMode(self.guidance))
        if self.rollout_mode is SiteMode.GUIDED:
            raise ValueError(f"{self.name}: the rollout runs OFF or RTN, not GUIDED")
        if self.loss not in LOSSES:
            raise ValueError(f"{self.name}: unknown loss {self.loss!r}; expected {sorted(LOSSES)}")
        if self.trainer_mode is SiteMode.GUIDED and self.guidance is None:
            raise ValueError(f"{self.name}: a GUIDED trainer needs rollout guidance")
        if self.guidance is not None and self.rollout_mode is not SiteMode.RTN:
            raise ValueError(f"{self.name}: only an FP4 (RTN) rollout can record guidance")
        if self.rollout_mode is SiteMode.OFF and self.trainer_mode is not SiteMode.OFF:
            raise ValueError(f"{self.name}: a bf16 rollout goes with a bf16 (OFF) trainer")
        if not 0.0 < self.guided_fraction <= 1.0:
            raise ValueError(f"{self.name}: guided_fraction must be in (0, 1]")
        bad = sorted({k for k, _ in self.trainer_overrides} - _QCFG_FIELDS)
        if bad:
            raise ValueError(f"{self.name}: trainer_overrides {bad} are not QuantConfig fields")
        if not 0.0 <= self.rollout_residual_channels < 1.0:
            raise ValueError(f"{self.name}: rollout_residual_channels must be in [0, 1)")

    def quant_configs(
        self, fmt: str, n_layers: int, *, guided_layers: tuple[int, ...] | None = None
    ) -> tuple[QuantConfig, QuantConfig]:
        """`(rollout_qcfg, trainer_qcfg)` for the recipe `fmt` and an `n_layers` model.

        `guided_layers` overrides the guided layers (e.g. the ablation's last 10 or 5 layers).
        """
        quant_preset(fmt)  # validates fmt, for bf16 too
        if self.rollout_mode is SiteMode.OFF:
            return QuantConfig.bf16(), QuantConfig.bf16()
        if guided_layers is None:
            guided_layers = deeper_layers(n_layers, self.guided_fraction)
        extra = {
            "guided_layers": tuple(guided_layers),
            "guidance_mode": self.guidance or GuidanceMode.COMPACT,
        }
        rollout = quant_preset(fmt, **extra)
        rollout.layers_guided(n_layers)  # raises on out-of-range guided layers
        trainer = quant_preset(fmt, **(extra | dict(self.trainer_overrides)))
        return rollout, trainer

    def setup(
        self, fmt: str, n_layers: int, *, guided_layers: tuple[int, ...] | None = None
    ) -> MethodSetup:
        """This method resolved for the recipe `fmt` and an `n_layers` model."""
        rollout, trainer = self.quant_configs(fmt, n_layers, guided_layers=guided_layers)
        capture = () if self.guidance is None else rollout.guided_keys(n_layers)
        return MethodSetup(
            method=self.name,
            fmt=fmt,
            rollout_qcfg=rollout,
            rollout_mode=self.rollout_mode,
            capture=capture,
            capture_mode=self.guidance or GuidanceMode.COMPACT,
            trainer_qcfg=trainer,
            trainer_mode=self.trainer_mode,
            loss=self.loss,
            rollout_residual_channels=self.rollout_residual_channels,
        )

    def loss_fn(self, cfg: GRPOConfig) -> LossFn:
        """This method's loss with `cfg`'s hyper-parameters bound:
        `fn(logp_new, *, logp_old, logp_rollout, advantages, mask, logp_ref=None)`."""
        return bind_loss(self.loss, cfg)


def bind_loss(name: str, cfg: GRPOConfig) -> LossFn:
    """The loss called `name` with `cfg`'s hyper-parameters bound (see `GRPOConfig.loss_kwargs`)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}")
    return functools.partial(LOSSES[name], **cfg.loss_kwargs(name))


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            name="bf16",
            description="BF16 rollout and trainer: no quantization anywhere (reference curve)",
            rollout_mode=SiteMode.OFF,
            trainer_mode=SiteMode.OFF,
            loss="ppo_clip",
        ),
        Method(
            name="fp4_qat",
            description="vanilla FP4 QAT: FP4 RTN rollout, trainer RTN fake quant at all sites",
            rollout_mode=SiteMode.RTN,
            trainer_mode=SiteMode.RTN,
            loss="ppo_clip",
        ),
        Method(
            name="qarl",
            description="QaRL: trainer forward on the rollout's quantized weights and "
            "activations (STE), TBPO objective",
            rollout_mode=SiteMode.RTN,
            trainer_mode=SiteMode.RTN,
            loss="tbpo",
        ),
        Method(
            name="quads",
            description="QUADS: trainer fake-quantizes expert weights only (activations bf16); "
            "W4A4 rollout with residual activation compensation",
            rollout_mode=SiteMode.RTN,
            trainer_mode=SiteMode.RTN,
            loss="ppo_clip",
            trainer_overrides=(("activation_format", None), ("kv_format", None)),
            rollout_residual_channels=0.0625,
        ),
        Method(
            name="trace",
            description="TRACE: compact rollout guidance (mantissa bit + scales) on the deeper "
            "half, guided trainer fake quant",
            rollout_mode=SiteMode.RTN,
            trainer_mode=SiteMode.GUIDED,
            loss="ppo_clip",
            guidance=GuidanceMode.COMPACT,
            guided_fraction=0.5,
        ),
        Method(
            name="trace_full",
            description="TRACE with full guidance (rollout codes + scales) on every layer",
            rollout_mode=SiteMode.RTN,
            trainer_mode=SiteMode.GUIDED,
            loss="ppo_clip",
            guidance=GuidanceMode.FULL,
            guided_fraction=1.0,
        ),
    )
}


def get_method(name: str) -> Method:
    """The method called `name` (see `METHODS`)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(METHODS)}")
    return METHODS[name]
