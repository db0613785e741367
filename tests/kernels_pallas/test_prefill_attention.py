"""Prefill flash attention (`kernels_pallas.prefill_attention`) against a float64 numpy reference
of the same mask (slot s visible to query t of row b iff s <= positions[b, t] and
s < kv_lengths[b]).

Shapes: B = 3, T = 12 queries, Hkv = 2, G = 4, Dh = 32, S = 40 cache slots, tiles of 16 rows and
16 slots, so each row's loop ends at a block boundary somewhere. Rows: a prompt from position 0
with padding queries past its length; a later chunk (positions 5..16, the last tile's last
position on a block's first slot); a row whose valid slots exceed S (clipped).

Tolerance. float32 operands: the kernel sums exp-weighted products in another order and scale
than the reference, |error| <= 1e-5 * (P @ |V|) (P the exact probabilities), far below a wrong
mask or a lost block (the probability mass of one slot, >= 1/40 here). bfloat16 operands: both
round the probabilities to bfloat16 (2**-9 relative) and the output (2**-9), so the bound is
2**-7 * (P @ |V|) + 2**-8 |out|.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.prefill_attention import (
    BlockConfig,
    block_config,
    prefill_attention,
    prefill_attention_pallas,
    prefill_attention_reference,
)
from tests.kernels_pallas.triton_lowering import assert_lowers_to_triton_for_h200

B, T, HKV, G, DH, S = 3, 12, 2, 4, 32, 40
TILES = dict(block_r=16, block_s=16)
POSITIONS = np.stack([np.arange(T), 5 + np.arange(T), 20 + np.arange(T)]).astype(np.int32)
KV_LENGTHS = np.asarray([9, 17, 100], np.int32)  # row 0: queries 9.. are padding; row 2: > S


def operands(dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, HKV, G, DH), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, HKV, DH), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, HKV, DH), jnp.float32).astype(dtype)
    return q, k, v, jnp.asarray(POSITIONS), jnp.asarray(KV_LENGTHS)


def exact(q, k, v, positions, kv_lengths):
    """float64 (out, P @ |V|) [B, T, Hkv, G, Dh] of the operands' values."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    slots = np.arange(k.shape[1])
    seen = (slots[None, None] <= np.asarray(positions)[:, :, None]) & (
        slots[None, None] < np.asarray(kv_lengths)[:, None, None]
    )  # [B, T, S]
    scores = np.einsum("btngc,bsnc->btngs", q, k) * q.shape[-1] ** -0.5
    scores = np.where(seen[:, :, None, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("btngs,bsnc->btngc", p, v), np.einsum("btngs,bsnc->btngc", p, np.abs(v))


def assert_close(out, ops, dtype):
    ref, mag = exact(*ops)
    out = np.asarray(out, np.float64)
    if dtype == jnp.float32:
        bound = 1e-5 * mag
    else:
        bound = 2.0**-7 * mag + 2.0**-8 * np.abs(out)
    err = np.abs(out - ref)
    assert np.all(err <= bound), f"max error {err.max():.3g}, {np.max(err / bound):.3g} x bound"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_matches_float64_reference(dtype, implementation):
    ops = operands(dtype)
    out = prefill_attention(*ops, implementation=implementation, interpret=True, **TILES)
    assert out.shape == (B, T, HKV, G, DH) and out.dtype == dtype
    assert_close(out, ops, dtype)


def test_default_tiles_and_tiles_that_do_not_divide():
    """Default tiles (one 64-row tile, one 64-slot block over 40 slots) and 32-row tiles over
    48 rows (the rows padded), the same product."""
    ops = operands(jnp.float32, seed=1)
    assert block_config(T * G, S) == BlockConfig(block_r=64, block_s=64)
    for tiles in ({}, dict(block_r=32, block_s=32)):
        out = prefill_attention(*ops, implementation="pallas", interpret=True, **tiles)
        assert_close(out, ops, jnp.float32)


def test_rows_with_no_slot_are_zero_and_others_unaffected():
    q, k, v, positions, _ = operands(jnp.float32, seed=2)
    kv_lengths = jnp.asarray([0, 17, 40], jnp.int32)
    out = np.asarray(prefill_attention(q, k, v, positions, kv_lengths, implementation="pallas",
                                       interpret=True, **TILES))  # fmt: skip
    np.testing.assert_array_equal(out[0], 0.0)
    ops = (q[1:], k[1:], v[1:], positions[1:], kv_lengths[1:])
    assert_close(out[1:], ops, jnp.float32)


def test_reference_is_the_xla_implementation_and_the_default_off_gpu():
    ops = operands(jnp.bfloat16, seed=3)
    ref = prefill_attention_reference(*ops[:4], jnp.minimum(ops[4], S))
    for implementation in ("xla", None):
        out = prefill_attention(*ops, implementation=implementation)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_bad_inputs_raise_clear_errors():
    q, k, v, positions, kv_lengths = operands(jnp.float32)
    run = functools.partial(prefill_attention, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match=r"q must be \[B, T, Hkv, G, Dh\]"):
        run(q[..., 0], k, v, positions, kv_lengths)
    with pytest.raises(ValueError, match=r"k must be \[B, S, Hkv, Dh\]"):
        run(q, k[:, :, :1], v, positions, kv_lengths)
    with pytest.raises(ValueError, match="v must have q's dtype"):
        run(q, k, v.astype(jnp.bfloat16), positions, kv_lengths)
    with pytest.raises(ValueError, match="positions must be int32"):
        run(q, k, v, positions.astype(jnp.float32), kv_lengths)
    with pytest.raises(ValueError, match="kv_lengths must be int32"):
        run(q, k, v, positions, kv_lengths[:2])
    with pytest.raises(ValueError, match="block_s must be a power of two >= 16"):
        run(q, k, v, positions, kv_lengths, block_s=24)
    odd = (q[..., :24], k[..., :24], v[..., :24], positions, kv_lengths)
    with pytest.raises(NotImplementedError, match="power-of-two head_dim"):
        run(*odd)
    out = prefill_attention(*odd, implementation=("pallas", "xla"), interpret=True)
    assert_close(out, (*odd[:3], positions, kv_lengths), jnp.float32)  # the reference ran


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_h200():
    ops = operands(jnp.bfloat16)
    config = BlockConfig(block_r=16, block_s=16, num_warps=4, num_stages=2)
    assert_lowers_to_triton_for_h200(
        functools.partial(prefill_attention_pallas, config=config), *ops
    )


MOSAIC = dict(interpret=pltpu.InterpretParams(), block_r=16, block_s=128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mosaic_kernel_matches_float64_reference(dtype):
    """The Mosaic kernel with TPU semantics: 3 row tiles of 16 rows (48 rows, the last one
    padded), a cache of 200 slots in two 128-slot blocks (the edge block padded), row 2's last
    tile reaching one slot into the second block; row 2's kv_lengths past S."""
    q, _, _, positions, _ = operands(dtype)
    kk, kv = jax.random.split(jax.random.key(9))
    k = jax.random.normal(kk, (B, 200, HKV, DH), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, 200, HKV, DH), jnp.float32).astype(dtype)
    # Row 2's last tile ends at position 128, the second block's first slot.
    positions = positions.at[2].set(117 + jnp.arange(T, dtype=jnp.int32))
    kv_lengths = jnp.asarray([9, 17, 300], jnp.int32)
    ops = (q, k, v, positions, kv_lengths)
    out = prefill_attention(*ops, implementation="pallas", **MOSAIC)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, (q, k, v, positions, jnp.minimum(kv_lengths, 200)), dtype)


def test_mosaic_kernel_default_tiles_and_an_empty_row():
    q, k, v, positions, _ = operands(jnp.float32, seed=4)
    kv_lengths = jnp.asarray([0, 17, 40], jnp.int32)
    out = np.asarray(prefill_attention(q, k, v, positions, kv_lengths, implementation="pallas",
                                       interpret=pltpu.InterpretParams()))  # fmt: skip
    np.testing.assert_array_equal(out[0], 0.0)
    assert_close(out[1:], (q[1:], k[1:], v[1:], positions[1:], kv_lengths[1:]), jnp.float32)
    with pytest.raises(ValueError, match="block_s must be a positive multiple of 128"):
        prefill_attention(
            q, k, v, positions, kv_lengths, **(MOSAIC | {"block_s": 64}), implementation="pallas"
        )
    with pytest.raises(ValueError, match="block_r must be a positive multiple of 16"):
        prefill_attention(
            q, k, v, positions, kv_lengths, **(MOSAIC | {"block_r": 8}), implementation="pallas"
        )


def test_mosaic_kernel_lowers_for_a_tpu():
    """Built for a TPU, the op is one `tpu_custom_call` named for the kernel (nothing runs)."""
    from kernels_pallas import common

    ops = operands(jnp.bfloat16)
    with common.lowering_for("tpu"):
        lowered = jax.jit(prefill_attention).trace(*ops).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == 1 and 'kernel_name = "prefill_attention_mosaic"' in text
