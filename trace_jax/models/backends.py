"""Which kernels a forward call runs: the one home of the model's backend choice.

A forward call's quantization site carries its `implementation` ("xla" or "pallas",
`site_implementation`; `trace_jax.quant.QuantSites` sets it, the rollout passes it, the trainer
keeps "xla", which is differentiable). With "pallas" the model runs the kernel ops
(`kernels_pallas`) with `kernel_order` (the routed experts' FP4 matmul with `expert_kernel_order`,
a prefill chunk's attention with `prefill_attention_order`); with "xla" it runs plain XLA. A
rollout's setting "auto" becomes one of the two here (`resolve_implementation`): the Pallas
kernels where they compile natively (Triton on an NVIDIA GPU, Mosaic on a TPU), XLA elsewhere.
"pallas" elsewhere needs interpretation asked for explicitly (`kernels_pallas.common.interpreting`),
as tests on the CPU do.
"""

from __future__ import annotations

from typing import Any

from kernels_pallas import common
from kernels_pallas.common import Implementation
from kernels_pallas.fp4_moe_matmul import MoEImplementation
from kernels_pallas.fp4_moe_matmul import api as fp4_moe_matmul_api


def site_implementation(site: Any) -> Implementation:
    """The kernels a forward call with `site` runs: its `implementation` attribute, XLA for a site
    without one (`identity_site`, plain functions)."""
    return Implementation(getattr(site, "implementation", Implementation.XLA))


def kernel_order(implementation: Implementation) -> tuple[Implementation, ...]:
    """The `implementation=` the model passes to every kernel op: for PALLAS the Pallas kernel
    (`kernels_pallas.common.pallas_target`: native, or as the `interpreting` context says) and the
    op's XLA reference where the kernel cannot take the shapes (the fused quantize tiles
    power-of-two rows only; its reference gives the same codes); for XLA the reference.

    Raises `kernels_pallas.common.PallasUnavailableError` for PALLAS where Pallas does not compile
    and no interpretation was asked for, rather than let every op fall back to XLA unseen."""
    if Implementation(implementation) is Implementation.PALLAS:
        common.pallas_target()
        return (Implementation.PALLAS, Implementation.XLA)
    return (Implementation.XLA,)


def expert_kernel_order(implementation: Implementation) -> tuple[MoEImplementation, ...]:
    """The `implementation=` the model passes to the routed experts' FP4 matmul
    (`kernels_pallas.fp4_moe_matmul`): `kernel_order`, led for PALLAS on a GPU that multiplies
    block-scaled FP4 in hardware (compute capability >= 10: Blackwell) by cuDNN's block-scaled
    matmul, "scaled_matmul", which steps aside (NotImplementedError) for operand formats cuDNN
    lacks. That path has not run on such a GPU here (none was available): only its selection
    and its CPU decomposition are tested."""
    order = tuple(MoEImplementation(i) for i in kernel_order(implementation))
    if order[0] is MoEImplementation.PALLAS and fp4_moe_matmul_api.native_block_scaled():
        return (MoEImplementation.SCALED_MATMUL, *order)
    return order


# What a rollout's `implementation` setting may say (`rl.rollout_implementation`).
IMPLEMENTATION_SETTINGS = ("auto", *(i.value for i in Implementation))


def resolve_implementation(setting: str | Implementation) -> Implementation:
    """The kernels a rollout runs for its setting: "pallas" or "xla" as named, "auto" the Pallas
    kernels where they compile natively (`kernels_pallas.common.native_lowering`: Triton on a GPU,
    Mosaic on a TPU) and XLA elsewhere (there Pallas only interprets: the same codes, far
    slower). Raises ValueError for another setting."""
    if setting not in IMPLEMENTATION_SETTINGS:
        raise ValueError(
            f"implementation must be one of {list(IMPLEMENTATION_SETTINGS)}, got {setting!r}"
        )
    if setting == "auto":
        return Implementation.PALLAS if common.native_lowering() else Implementation.XLA
    return Implementation(setting)


# `ModelConfig.prefill_attention` settings; "auto" is decided by `prefill_attention_order`.
PREFILL_ATTENTION = ("xla", "pallas", "cudnn", "auto")


def prefill_attention_order(setting: str) -> tuple[Implementation, ...]:
    """The `implementation=` a prefill chunk's attention passes to `kernels_pallas.
    prefill_attention` for `ModelConfig.prefill_attention`: "xla" the reference; "pallas" the
    kernel (`kernel_order`); "cudnn" the kernel as well, for the chunks cuDNN cannot express
    (those that do not start at slot 0); "auto" the kernel where Pallas compiles natively (a
    GPU: Triton, a TPU: Mosaic), else the reference."""
    if setting == "auto":
        setting = "pallas" if common.native_lowering() else "xla"
    elif setting == "cudnn":
        setting = "pallas"
    return kernel_order(Implementation(setting))
