"""The Triton lowering check the kernel tests share: a function lowered for an abstract H200."""

from __future__ import annotations

import jax


def assert_lowers_to_triton_for_h200(f, *args) -> str:
    """`jax.jit(f)(*args)` exports for CUDA with a Pallas Triton call in its module, lowered for
    an (abstract) H200: Triton IR is made, nothing is compiled or run. Returns the module's
    text (StableHLO, the Triton calls' names in their backend configs)."""
    from jax.experimental.pallas import triton as plgpu

    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    checks = [jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)]
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args)
    text = exported.mlir_module()
    assert plgpu.CUSTOM_CALL_TARGET_NAME in text
    return text
