"""Benchmark inputs and ceilings from the harness: random K/V, the packed FP4 cache and the
bandwidth ceilings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import harness
from trace_jax import fp4


def test_random_kv_is_bf16_and_seeded():
    """K from key `seed`, V from key `seed + 1`: standard normal bf16."""
    k, v = harness.random_kv(2, 5, 3, 16, seed=7)
    assert k.shape == v.shape == (2, 5, 3, 16) and k.dtype == v.dtype == jnp.bfloat16
    for got, seed in ((k, 7), (v, 8)):
        want = jax.random.normal(jax.random.key(seed), (2, 5, 3, 16), jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
def test_packed_kv_cache_holds_every_slot_rounded_to_nearest(fmt):
    k, _ = harness.random_kv(2, 7, 3, 32, seed=1)
    cache = harness.packed_kv_cache(k, fmt)
    assert cache.shape == (2, 7, 3, 32) and cache.fmt == fmt
    want = fp4.dequantize(fp4.quantize(k.astype(jnp.float32), fmt), jnp.float32)
    np.testing.assert_array_equal(np.asarray(cache.read(jnp.float32)), np.asarray(want))


def test_ceilings_are_bytes_over_seconds(monkeypatch):
    """read: n bytes over the faster of two reductions; copy: 2 n bytes over the add."""
    seconds = iter([4.0, 2.0, 8.0])  # byte sum, word sum, add
    monkeypatch.setattr(harness, "time_fn", lambda *a, **k: next(seconds))
    ceil = harness.ceilings(1 << 12, smoke=True)
    assert ceil == {"read_bw": (1 << 12) / 2.0, "copy_bw": 2 * (1 << 12) / 8.0}
