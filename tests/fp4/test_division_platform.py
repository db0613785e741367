"""The quantizer's one float32 division, `scales.reciprocal`, per platform.

On the CPU it is IEEE (correctly rounded). On NVIDIA GPUs XLA and Pallas' Triton lowering both emit
the approximate `div.full.f32` (openxla/xla#37181; 13% of random reciprocals one ulp off on the
H200, experiments/results/gpu_division.md), so the NVFP4 quantizer can differ between CPU and GPU
in rare elements. What TRACE needs is that rollout (Pallas) and trainer (XLA) agree on the same
GPU: the GPU test below checks that they compute the same bits, and fails if either side ever
changes its division alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from trace_jax.fp4 import scales

N = 1 << 20
BLOCK = 1024


def _divisors(n: int = N) -> np.ndarray:
    """Random float32 divisors over 2**-60 .. 2**60 (the range of NVFP4 combined scales)."""
    rng = np.random.default_rng(0)
    return (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)


def _pallas_reciprocal(d: jax.Array, interpret: bool) -> jax.Array:
    def kernel(d_ref, o_ref):
        o_ref[...] = scales.reciprocal(d_ref[...])

    spec = pl.BlockSpec((BLOCK,), lambda i: (i,))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(d.shape, jnp.float32),
        grid=(d.size // BLOCK,),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
    )(d)


def test_cpu_reciprocal_is_correctly_rounded():
    """Under jit on the CPU, XLA and the Pallas kernel in interpret mode: numpy's IEEE float32
    1 / d, bit for bit."""
    d = _divisors(1 << 16)
    with jax.default_device(jax.devices("cpu")[0]):
        xla = jax.jit(scales.reciprocal)(jnp.asarray(d))
        kernel = _pallas_reciprocal(jnp.asarray(d), interpret=True)
    np.testing.assert_array_equal(np.asarray(xla), np.float32(1) / d)
    np.testing.assert_array_equal(np.asarray(kernel), np.float32(1) / d)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_xla_and_pallas_reciprocals_agree():
    """XLA's and the Pallas kernel's float32 reciprocals are the same bits on the GPU (both
    `div.full.f32` today); how many differ from IEEE is printed for the record."""
    d = jnp.asarray(_divisors())
    xla = np.asarray(jax.jit(scales.reciprocal)(d))
    kernel = np.asarray(_pallas_reciprocal(d, interpret=False))
    ieee = np.float32(1) / np.asarray(d)
    print(f"of {N}: XLA != IEEE {(xla != ieee).sum()}, Pallas != IEEE {(kernel != ieee).sum()}")
    np.testing.assert_array_equal(kernel, xla)
