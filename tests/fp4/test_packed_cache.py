"""The packed FP4 KV cache storage: head-major layout, writes of quantized codes, reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache
from trace_jax.fp4.packed_cache import write_slots
from trace_jax.rl.sharding import make_mesh
from trace_jax.rollout.collectives import hlo_collectives


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
def test_packed_cache_is_head_major_and_reads_back_the_quantizer(fmt):
    """Writes land at (b, kv head, slot) of the head-major arrays, exactly the quantizer's packed
    codes; out-of-range slots are dropped; `read` gives [B, S, Hkv, Dh] = the quantizer's values
    at written slots and zeros elsewhere."""
    b, s, hkv, dh, t = 2, 6, 3, 32, 2
    x = 3.0 * jax.random.normal(jax.random.key(8), (b, t, hkv, dh))
    slots = jnp.array([[4, 1], [0, s]])  # row 1's second token is out of range: dropped
    q = fp4.quantize(x, fmt)
    cache = PackedTensorCache.empty((b, s, hkv, dh), fmt).write(q, slots)
    assert cache.shape == (b, s, hkv, dh) and cache.codes.shape == (b, hkv, s, dh // 2)
    packed = np.asarray(fp4.pack_fp4(q.codes))
    codes = np.asarray(cache.codes)
    for bi, ti, si in ((0, 0, 4), (0, 1, 1), (1, 0, 0)):
        for h in range(hkv):
            np.testing.assert_array_equal(codes[bi, h, si], packed[bi, ti, h])
    assert not codes[1, :, 1:].any() and not codes[0, :, [0, 2, 3, 5]].any()
    got = np.asarray(cache.read(jnp.float32))
    want = np.zeros((b, s, hkv, dh), np.float32)
    deq = np.asarray(fp4.dequantize(q))
    want[0, 4], want[0, 1], want[1, 0] = deq[0, 0], deq[0, 1], deq[1, 0]
    np.testing.assert_array_equal(got, want)
    # Bytes: 4-bit codes, one scale byte per block, NVFP4's float32 global scale per row.
    per_row = dh // 2 + dh // fmt.block_size + (4 if fmt.has_global_scale else 0)
    assert cache.nbytes == b * s * hkv * per_row


def test_empty_and_write_reject_what_the_cache_cannot_hold():
    with pytest.raises(ValueError, match="stores FP4; got mxfp8"):
        PackedTensorCache.empty((1, 4, 2, 32), fp4.MXFP8)
    with pytest.raises(ValueError, match="head_dim 16 is not a multiple of the mxfp4 block 32"):
        PackedTensorCache.empty((1, 4, 2, 16), fp4.MXFP4)
    cache = PackedTensorCache.empty((2, 4, 2, 32), fp4.NVFP4)
    x = jnp.ones((2, 1, 2, 32))
    slots = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="holds nvfp4; got a mxfp4 QTensor"):
        cache.write(fp4.quantize(x, fp4.MXFP4), slots)
    with pytest.raises(ValueError, match=r"\(B, Hkv, Dh\) = \(2, 2, 32\)"):
        cache.write(fp4.quantize(jnp.ones((2, 1, 3, 32)), fp4.NVFP4), slots)
    with pytest.raises(ValueError, match="global_scale must be one per row"):
        cache.write(fp4.quantize(x, fp4.NVFP4, global_axes=(-2, -1)), slots)
    with pytest.raises(ValueError, match=r"slots must be \[B, T\]"):
        cache.write(fp4.quantize(x, fp4.NVFP4), slots[:, 0])


def test_writes_on_a_mesh_splitting_the_batch_stay_on_each_device():
    """The cache and slot writes of a data-parallel rollout: on a 2-device mesh with rows split,
    `write_slots` (slots along axis 1 and 2) and `PackedTensorCache.write` equal the unsharded
    writes and a loop-written reference bit for bit, and the compiled program moves nothing
    between devices (a scatter indexed by `arange(B)` all-gathers its indices and updates)."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py)")
    mesh = make_mesh(2)
    b, s, h, d, t = 4, 8, 2, 32, 3
    rng = np.random.default_rng(0)
    buf = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
    val = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    slots = jnp.asarray([[0, 5, 7], [2, 3, s], [1, 1 + s, 6], [4, 0, 3]], jnp.int32)
    want = np.asarray(buf).copy()
    for bi in range(b):
        for ti in range(t):
            if slots[bi, ti] < s:
                want[bi, int(slots[bi, ti])] = np.asarray(val)[bi, ti]
    head_major = jnp.swapaxes(buf, 1, 2)
    x = 3.0 * jax.random.normal(jax.random.key(1), (b, t, h, d))
    cache = PackedTensorCache.empty((b, s, h, d), fp4.NVFP4)
    cases = {
        "axis 1": (lambda u, v, sl: write_slots(u, v, sl), (buf, val, slots)),
        "axis 2": (lambda u, v, sl: write_slots(u, jnp.swapaxes(v, 1, 2), sl, axis=2),
                   (head_major, val, slots)),
        "packed cache": (lambda c, v, sl: c.write(fp4.quantize(v, fp4.NVFP4), sl),
                         (cache, x, slots)),
    }  # fmt: skip
    for name, (fn, args) in cases.items():
        plain = jax.jit(fn)(*args)
        with jax.set_mesh(mesh):
            split = jax.device_put(args, NamedSharding(mesh, P("data")))
            f = jax.jit(fn)
            got = f(*split)
            hlo = f.lower(*split).compile().as_text()
        for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=name)
        assert not hlo_collectives(hlo), (name, hlo_collectives(hlo))
    np.testing.assert_array_equal(np.asarray(write_slots(buf, val, slots)), want)
    head = np.asarray(write_slots(head_major, jnp.swapaxes(val, 1, 2), slots, axis=2))
    np.testing.assert_array_equal(np.swapaxes(head, 1, 2), want)
