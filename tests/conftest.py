"""Suite set-up (must precede the first jax import): 8 host devices for sharding tests,
and one persistent XLA compilation cache shared by every test run on this machine."""

import gc
import os
import tempfile

import pytest

# Tracing allocates millions of short-lived objects: at Python's default thresholds (700, 10, 10)
# a worker spends about 4% of its time in the cycle collector. A young generation of 50,000
# objects makes collections rare (measured: under 1% of the time, the same peak memory).
gc.set_threshold(50_000, 10, 10)

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
# Every compile of 0.1 s or more (JAX's default: 1 s): a subprocess of the fault and
# multi-process tests otherwise compiles again each small program its parent or a sibling already
# compiled (measured: 208 instead of 19 cache hits in the workers, the suite 34 s shorter).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")


@pytest.fixture
def triton_lowering(monkeypatch):
    """`target(version)`: Pallas' Triton lowering told it targets that GPU
    (`jax.experimental.pallas.triton.GpuVersion`, e.g. H200 or B200), and kernels built for a GPU
    (`kernels_pallas.common.lowering_for("gpu")`), so that kernels and their apis lower to Triton
    IR on a CPU machine (`jit(f).trace(...).lower(lowering_platforms=("cuda",))`); PTX needs a
    real GPU. `target.queried` lists the GPUs the lowering asked about. Skips when the private
    hooks have moved."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
        from jax.experimental.pallas import triton as plgpu

        registration.gpu_info_lib.get_gpu_info  # noqa: B018 (the hook the fixture replaces)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"private Pallas Triton hooks moved: {e}")
    from kernels_pallas import common

    def target(version):
        info = plgpu.get_gpu_info_from_version(version)

        def get_gpu_info():
            target.queried.append(info.gpu_version)
            return info

        monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", get_gpu_info)

    target.queried = []
    with common.lowering_for("gpu"):
        yield target


@pytest.fixture
def h200_triton_lowering(triton_lowering):
    """`triton_lowering` targeting an H200."""
    from jax.experimental.pallas import triton as plgpu

    triton_lowering(plgpu.GpuVersion.H200)


@pytest.fixture
def pallas_interpreted_on_cpu():
    """Pallas kernels called without their own `interpret=` (the model's, a rollout's) run in
    Pallas' generic interpreter (the Triton kernels) where Pallas does not compile natively, and
    natively on a GPU or a TPU: `kernels_pallas.common.interpreting`, the one explicit way. Test
    modules that run Pallas on the CPU use it (`pytest.mark.usefixtures`)."""
    from kernels_pallas import common

    with common.interpreting(common.native_lowering() is None):
        yield


@pytest.fixture(scope="module")
def s3_server():
    """A local S3-compatible server (`tests.s3_server.LocalS3`) for the module, with the keys
    tensorstore signs with in the environment."""
    from tests.s3_server import LocalS3

    server = LocalS3()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in server.env.items():
            mp.setenv(name, value)
        yield server
    server.stop()


# Every compiled XLA:CPU executable keeps ~10-100 memory mappings (its JIT-linked code and data)
# for as long as a jit cache holds it, and a worker runs ~500 tests: past Linux's default
# vm.max_map_count (65530) the next compile or cache load dies with SIGSEGV inside LLVM. So a
# worker near the limit drops JAX's caches (later tests recompile what they need).
_MAP_COUNT_LIMIT = 40_000
# Counting reads /proc/self/maps (about 1 ms per 1,000 mappings), so a worker well below the
# limit counts again only after a test per `_MAPS_PER_TEST` mappings of headroom: one test adds a
# few thousand at most, and the limit leaves 25,000 to the kernel's.
_MAPS_PER_TEST = 10_000
_tests_until_count = 0


def _map_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    global _tests_until_count
    if _tests_until_count > 0:
        _tests_until_count -= 1
        return
    count = _map_count()
    if count > _MAP_COUNT_LIMIT:
        import jax

        jax.clear_caches()
        gc.collect()
    _tests_until_count = max(0, _MAP_COUNT_LIMIT - count) // _MAPS_PER_TEST
