"""Suite set-up (must precede the first jax import): 8 host devices for sharding tests,
and one persistent XLA compilation cache shared by every test run on this machine."""

import os
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_ENABLE_X64", "0")
# Tests run tiny models: XLA's compile time dominates their run time, so skip its expensive
# optimization passes (about 15% less compile time; results are IEEE-exact either way).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Many tests compile the same tiny-model sampler and train steps (in both xdist workers, and in
# the subprocesses of the disaggregated-runner tests, which inherit this environment); a cache hit
# skips a 5-15 s CPU compile. Entries are keyed by the computation, devices and flags.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"trace_jax_test_xla_cache_{os.getuid()}"),
)


@pytest.fixture
def h200_triton_lowering(monkeypatch):
    """Pallas' Triton lowering told it targets an H200, so kernels lower to Triton IR on a CPU
    machine (`jit(f).trace(...).lower(lowering_platforms=("cuda",))`); PTX needs a real GPU.
    Skips when the private hooks have moved."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
        from jax.experimental.pallas import triton as plgpu

        h200 = plgpu.get_gpu_info_from_version(plgpu.GpuVersion.H200)
        monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: h200)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"private Pallas Triton hooks moved: {e}")
