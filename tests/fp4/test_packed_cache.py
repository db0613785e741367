"""The packed FP4 KV cache storage: head-major layout, writes of quantized codes, reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache


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
