"""The profiling harness launches every kernel it names, each checked against its reference."""

from __future__ import annotations

import pytest

from configs import profile_kernels as config_module
from experiments import profile_kernels

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def test_every_kernel_launches_and_matches_its_reference():
    config = config_module.get_config("smoke")
    config.launches = 2
    errors = profile_kernels.launch_all(config)
    assert set(errors) == {
        "fp4_decode_attn",
        "bf16_decode_attn",
        "fp4_quantize nvfp4",
        "fp4_quantize mxfp4",
    }
    assert errors["fp4_quantize nvfp4"] == errors["fp4_quantize mxfp4"] == 0.0  # bit-exact
    assert 0 < errors["fp4_decode_attn"] < 1e-2 and 0 < errors["bf16_decode_attn"] < 1e-2
