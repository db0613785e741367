"""fake_quant: forward equals dequantize(quantize(x)); straight-through gradient; transforms."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from trace_jax import fp4

NAMES = ("mxfp4", "nvfp4", "mxfp8")
U32 = 2.0**-24  # float32 unit roundoff


def _x(shape=(8, 64), seed=0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(seed), shape) * 2).astype(dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_is_dequantize_of_quantize(name, dtype):
    x = _x(dtype=dtype)
    y = jax.jit(lambda x: fp4.fake_quant(x, name))(x)
    assert y.dtype == dtype and y.shape == x.shape
    want = fp4.dequantize(fp4.quantize(x, name), dtype)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("rounding", ["rtn", "stochastic", "guided-full", "guided-compact"])
def test_straight_through_gradient(rounding):
    x = _x()
    w = _x(seed=1)
    kwargs = {}
    if rounding == "stochastic":
        kwargs["key"] = jax.random.key(5)
    elif rounding.startswith("guided"):
        q_roll = fp4.quantize(x * 1.01, "nvfp4")
        kwargs["guidance"] = fp4.make_guidance(q_roll, rounding.split("-")[1])
    mode = rounding.split("-")[0]

    def loss(x):
        return jnp.sum(fp4.fake_quant(x, "nvfp4", rounding=mode, **kwargs) * w)

    g = jax.jit(jax.grad(loss))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_gradient_flows_through_a_matmul():
    x = _x((4, 32))
    w = _x((32, 32), seed=2)

    def loss(w):
        return jnp.sum((fp4.fake_quant(x, "mxfp4") @ fp4.fake_quant(w.T, "mxfp4").T) ** 2)

    g = jax.grad(loss)(w)
    xq = fp4.fake_quant(x, "mxfp4")
    wq = fp4.fake_quant(w.T, "mxfp4").T
    want = xq.T @ (2 * xq @ wq)
    # Both sides compute xq^T (2 xq wq) in float32, in any summation order: each is within
    # n u sum|terms| of the exact value at each of its two dots (u = 2**-24), so they differ by
    # at most twice that (an error in the straight-through rule is O(1) relative).
    a, b = (np.abs(np.asarray(v, np.float64)) for v in (xq, wq))
    y = a @ b  # sum of |products| of xq @ wq
    one = 2 * a.T @ (x.shape[1] * U32 * y) + x.shape[0] * U32 * 2 * a.T @ y
    err = np.abs(np.asarray(g, np.float64) - np.asarray(want))
    assert np.all(err <= 2 * one), f"max |error| {err.max():.3g}, bound there {2 * one.max():.3g}"


def test_vmap_scan_remat_match_plain():
    x = _x((4, 8, 64))
    plain = fp4.fake_quant(x, "nvfp4")
    vm = jax.vmap(lambda t: fp4.fake_quant(t, "nvfp4"))(x)
    np.testing.assert_array_equal(vm, plain)

    def body(carry, t):
        return carry + jnp.sum(fp4.fake_quant(t, "nvfp4")), fp4.fake_quant(t, "nvfp4")

    total, sc = jax.lax.scan(body, 0.0, x)
    np.testing.assert_array_equal(sc, plain)
    # Two summation orders of the same n terms: each within (n - 1) u sum|terms| of the exact sum.
    n = plain.size
    bound = 2 * (n - 1) * U32 * float(np.abs(np.asarray(plain, np.float64)).sum())
    assert abs(float(total) - float(jnp.sum(plain))) <= bound

    remat = jax.jit(jax.checkpoint(lambda t: fp4.fake_quant(t, "nvfp4")))(x)
    np.testing.assert_array_equal(remat, plain)
    g = jax.grad(lambda t: jnp.sum(jax.checkpoint(lambda u: fp4.fake_quant(u, "nvfp4"))(t) ** 2))(x)
    np.testing.assert_allclose(g, 2 * plain, rtol=1e-6)


def test_vmap_over_guidance():
    x = _x((3, 4, 64))
    g = jax.vmap(lambda t: fp4.make_guidance(fp4.quantize(t * 1.02, "mxfp4"), "compact"))(x)
    out = jax.vmap(lambda t, gg: fp4.fake_quant(t, "mxfp4", rounding="guided", guidance=gg))(x, g)
    whole = fp4.make_guidance(fp4.quantize(x * 1.02, "mxfp4"), "compact")
    np.testing.assert_array_equal(
        out, fp4.fake_quant(x, "mxfp4", rounding="guided", guidance=whole)
    )


def test_shard_map_over_a_data_mesh():
    n = jax.device_count()
    if n < 2:
        pytest.skip("needs several devices (tests/conftest.py forces 8 host devices)")
    mesh = jax.make_mesh((n,), ("data",))
    x = _x((n * 2, 64))
    g = fp4.make_guidance(fp4.quantize(x * 0.99, "nvfp4"), "full")
    x, g = jax.device_put((x, g), jax.NamedSharding(mesh, P("data")))

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")
    )
    def sharded(x, g):
        return fp4.fake_quant(x, "nvfp4", rounding="guided", guidance=g)

    want = fp4.fake_quant(x, "nvfp4", rounding="guided", guidance=g)
    with jax.set_mesh(mesh):
        out = sharded(x, g)
        grad = jax.grad(lambda x: jnp.sum(sharded(x, g)))(x)
    assert out.sharding.spec == P("data", None)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(grad, jnp.ones_like(x))
