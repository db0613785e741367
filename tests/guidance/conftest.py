"""Fixtures of the guidance tests."""

from __future__ import annotations

import jax
import pytest

from tests.guidance.support import capture
from trace_jax.fp4 import Guidance


@pytest.fixture(scope="module")
def rollout_guidance() -> dict[str, Guidance]:
    """Realistic guidance from the real quantizer: [B, T, ...] rows like the sampler's."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x_kv = jax.random.normal(k1, (2, 5, 2, 64)) * 3.0  # [B, T, H, Dh]
    x_act = jax.random.normal(k2, (2, 5, 128))  # [B, T, D]
    mask = jax.random.uniform(k3, (2, 5, 2)) < 0.6
    return {
        "3/k": capture(x_kv, mask, fmt="nvfp4", mode="full"),
        "3/v": capture(x_kv, fmt="nvfp4", mode="compact", global_axes=None),
        "3/expert_in": capture(x_act, fmt="mxfp4", mode="compact"),
        "3/expert_mid": capture(x_act, mask[..., 0], fmt="mxfp4", mode="full"),
        "4/expert_in": capture(x_act, fmt="mxfp8", mode="full"),
    }
