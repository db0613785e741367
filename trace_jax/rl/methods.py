"""The compared methods (SPEC 7) as data: how each one quantizes the rollout and the trainer.

A `Method` is format-free; `Method.setup(fmt, n_layers)` resolves it for one FP4 recipe of
`trace_jax.quant.QUANT_RECIPES` ("nvfp4", "mxfp4_w4a4", "mxfp4_w4a8", or any registered one) and
one model depth into a `MethodSetup`, whose fields
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

`METHODS` is open: `register_method(Method(...))` adds a method that every entry point can then
name (`rl.method`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from trace_jax.fp4 import GuidanceMode
from trace_jax.quant import (
    LayerSpec,
    QuantConfig,
    SiteMode,
    parse_layer_spec,
    quant_recipe,
    resolve_layers,
)
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.losses import LOSSES, LossFn, get_loss_fn

_QCFG_FIELDS = frozenset(f.name for f in dataclasses.fields(QuantConfig))


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
      guided_layers: the layers with guidance, a spec of `trace_jax.quant.resolve_layers`
        ("half": the paper's last 20 of 40 layers; "all"; "0,3"; a sequence of ints), held in
        `parse_layer_spec`'s canonical form.
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
    guided_layers: LayerSpec = "half"
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
        try:
            object.__setattr__(self, "guided_layers", parse_layer_spec(self.guided_layers))
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        bad = sorted({k for k, _ in self.trainer_overrides} - _QCFG_FIELDS)
        if bad:
            raise ValueError(f"{self.name}: trainer_overrides {bad} are not QuantConfig fields")
        if not 0.0 <= self.rollout_residual_channels < 1.0:
            raise ValueError(f"{self.name}: rollout_residual_channels must be in [0, 1)")

    def quant_configs(
        self, fmt: str, n_layers: int, *, guided_layers: LayerSpec | None = None
    ) -> tuple[QuantConfig, QuantConfig]:
        """`(rollout_qcfg, trainer_qcfg)` for the recipe `fmt` and an `n_layers` model.

        `guided_layers` overrides the method's guided-layer spec (e.g. the ablation's "quarter"
        or "eighth"); None keeps the method's own. Both configs hold the resolved layer indices,
        so equal layers give equal configs whichever spec named them.
        """
        quant_recipe(fmt)  # validates fmt, for bf16 too
        if self.rollout_mode is SiteMode.OFF:
            return QuantConfig.bf16(), QuantConfig.bf16()
        spec = self.guided_layers if guided_layers is None else guided_layers
        extra = {
            "guided_layers": resolve_layers(spec, n_layers),
            "guidance_mode": self.guidance or GuidanceMode.COMPACT,
        }
        rollout = quant_recipe(fmt, **extra)
        trainer = quant_recipe(fmt, **(extra | dict(self.trainer_overrides)))
        return rollout, trainer

    def setup(
        self, fmt: str, n_layers: int, *, guided_layers: LayerSpec | None = None
    ) -> MethodSetup:
        """This method resolved for the recipe `fmt` and an `n_layers` model (`guided_layers`:
        as in `quant_configs`)."""
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
    return functools.partial(get_loss_fn(name), **cfg.loss_kwargs(name))


# Name -> method: what `get_method` (and so `rl.method` in the experiment configs) resolves.
METHODS: dict[str, Method] = {}


def register_method(method: Method, *, replace: bool = False) -> Method:
    """Adds `method` to `METHODS` under `method.name`; returns it.

    Raises TypeError when `method` is not a `Method`, ValueError when its name is registered
    and not `replace`.
    """
    if not isinstance(method, Method):
        raise TypeError(f"register_method takes a Method; got {method!r}")
    if method.name in METHODS and not replace:
        raise ValueError(
            f"method {method.name!r} is already registered; pass replace=True to redefine it"
        )
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method called `name`."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(METHODS)}")
    return METHODS[name]


for _method in (
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
        guided_layers="half",
    ),
    Method(
        name="trace_full",
        description="TRACE with full guidance (rollout codes + scales) on every layer",
        rollout_mode=SiteMode.RTN,
        trainer_mode=SiteMode.GUIDED,
        loss="ppo_clip",
        guidance=GuidanceMode.FULL,
        guided_layers="all",
    ),
):
    register_method(_method)
del _method
