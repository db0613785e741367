"""Test session set-up: 8 host devices for sharding tests (must precede the first jax import)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_ENABLE_X64", "0")
