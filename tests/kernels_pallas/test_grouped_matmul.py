"""bf16 grouped matmul: every implementation against `jax.lax.ragged_dot` and float64.

One test base runs the shared cases through the api with a given implementation; each
implementation is a short subclass. Shapes: M = 40 rows (not a multiple of block_m = 16), K = 64,
N = 32, G = 4, with ragged group sizes (an empty group, a group of one, sum < M so trailing rows
must be 0).

Tolerance (float32 outputs): bf16 products are exact in float32, so kernel and reference each sum
the same exact products in float32 in some order, each within K u sum_k |a_k w_k| of the exact
float64 sum (u = 2**-24, `rounding.U32`); the test allows 2 K u |a| @ |w|^T per element against
the reference. A wrong row, group or K block misses by far more (the terms are O(1), the bound
O(1e-5)).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import common
from kernels_pallas.grouped_matmul import (
    BlockConfig,
    block_config,
    default_block_config,
    group_row_bounds,
    grouped_matmul,
    grouped_matmul_pallas,
    grouped_matmul_reference,
    grouped_matmul_with_implementation,
)
from tests.kernels_pallas.rounding import U32, U_BF16
from tests.kernels_pallas.triton_lowering import assert_lowers_to_triton_for_h200

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")

M, K, N, G = 40, 64, 32, 4
GROUP_SIZES = {
    "empty_one_ragged": (0, 1, 25, 9),  # sum 35 < M; tiles straddle groups
    "middle_empty": (7, 0, 0, 30),
    "one_group_all_rows": (0, 0, 40, 0),
    "all_empty": (0, 0, 0, 0),
}
SMALL_TILES = dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)


@functools.cache
def operands(m=M, k=K, n=N, dtype=jnp.bfloat16, seed=0):
    """Random normal lhs `[m, k]` and rhs `[G, n, k]` in `dtype`."""
    lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(jax.random.key(seed + 1), (G, n, k), jnp.float32).astype(dtype)
    return lhs, rhs


def float64_product(lhs, rhs, sizes):
    """(exact [M, N], |lhs| @ |rhs|^T per group [M, N]) in float64 numpy; rows past the groups 0."""
    a, w = (np.asarray(x, np.float64) for x in (lhs, rhs))
    exact, mag = np.zeros((a.shape[0], w.shape[1])), np.zeros((a.shape[0], w.shape[1]))
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        exact[rows], mag[rows] = a[rows] @ w[g].T, np.abs(a[rows]) @ np.abs(w[g]).T
        start += size
    return exact, mag


def assert_matches(out, lhs, rhs, sizes, *, exact_reference: bool):
    """out (float32) within the float32 summation bound of `ragged_dot`, or equal to it."""
    gs = jnp.asarray(sizes, jnp.int32)
    ref = np.asarray(grouped_matmul_reference(lhs, rhs, gs, out_dtype=jnp.float32))
    out = np.asarray(out)
    assert out.shape == ref.shape and out.dtype == np.float32
    if exact_reference:
        np.testing.assert_array_equal(out, ref)
    exact, mag = float64_product(lhs, rhs, sizes)
    bound = lhs.shape[1] * U32 * mag
    assert np.all(np.abs(ref - exact) <= bound)  # the reference itself, against float64
    err = np.abs(out - ref)
    assert np.all(err <= 2 * bound), f"max |error| {err.max():.3g}, bound {2 * bound.max():.3g}"
    np.testing.assert_array_equal(out[sum(sizes) :], 0.0)  # rows past sum(group_sizes)


class _Cases:
    """Shared cases; a subclass sets `implementation` (and `exact_reference` if it must equal the
    reference)."""

    implementation: ClassVar[str]
    exact_reference: ClassVar[bool] = False
    tiling: ClassVar[dict] = {}

    def op(self, lhs, rhs, group_sizes, **kwargs):
        return grouped_matmul(
            lhs, rhs, group_sizes, implementation=self.implementation, **self.tiling, **kwargs
        )

    def test_matches_reference(self):
        lhs, rhs = operands()
        run = jax.jit(lambda gs: self.op(lhs, rhs, gs, out_dtype=jnp.float32))  # one compile
        for sizes in GROUP_SIZES.values():
            out = run(jnp.asarray(sizes, jnp.int32))
            assert_matches(out, lhs, rhs, sizes, exact_reference=self.exact_reference)

    def test_bfloat16_output_and_fewer_rows_than_a_tile(self):
        """Default output dtype (lhs's, one bf16 rounding of the float32 sum); M = 10 < 16."""
        lhs, rhs = operands(m=10, seed=2)
        sizes = (3, 0, 2, 4)  # one row past the groups
        out = self.op(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        assert out.dtype == jnp.bfloat16 and out.shape == (10, N)
        exact, mag = float64_product(lhs, rhs, sizes)
        bound = U_BF16 * np.abs(exact) + 2 * K * U32 * mag
        assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= bound)
        np.testing.assert_array_equal(np.asarray(out[sum(sizes) :], np.float32), 0.0)

    def test_float32_operands(self):
        lhs, rhs = operands(dtype=jnp.float32, seed=4)
        sizes = GROUP_SIZES["empty_one_ragged"]
        out = self.op(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        assert_matches(out, lhs, rhs, sizes, exact_reference=self.exact_reference)


class TestXla(_Cases):
    implementation = "xla"
    exact_reference = True


class TestPallasInterpret(_Cases):
    implementation = "pallas"
    tiling: ClassVar[dict] = dict(SMALL_TILES, interpret=True)

    def test_default_tiles(self):
        """Default tiles: block_k = K (64), block_n = N (32), row tiles of 16."""
        lhs, rhs = operands(seed=6)
        sizes = GROUP_SIZES["middle_empty"]
        out = grouped_matmul(
            lhs,
            rhs,
            jnp.asarray(sizes, jnp.int32),
            implementation="pallas",
            interpret=True,
            out_dtype=jnp.float32,
        )
        assert_matches(out, lhs, rhs, sizes, exact_reference=False)
        config = block_config(M, G, K, N)
        assert (config.block_m, config.block_n, config.block_k) == (16, 32, 64)


def test_default_block_config_by_phase():
    """Row tiles follow the group sizes (1.5 x the mean); decode and prefill get their own tiles;
    explicit values stand and missing ones are filled in."""
    decode = default_block_config(512, 128, 2048, 768)
    assert (decode.block_m, decode.block_n, decode.block_k, decode.num_stages) == (16, 64, 128, 4)
    prefill = default_block_config(65536, 128, 2048, 768)
    assert (prefill.block_m, prefill.block_n, prefill.block_k) == (256, 128, 64)
    assert (prefill.num_warps, prefill.num_stages) == (8, 4)
    f32 = block_config(65536, 128, 2048, 768, dtype=jnp.float32)
    assert f32.block_k == 32  # the same shared memory per stage as bf16's 64
    assert default_block_config(8192, 128, 2048, 768).block_m == 128  # mean 64: 96 -> 128
    assert default_block_config(4096, 128, 2048, 768).block_m == 64
    assert default_block_config(8192, 128, 768, 2048).block_k == 64  # w_down: K = F
    mixed = block_config(65536, 128, 2048, 768, block_n=64, num_stages=5)
    assert (mixed.block_m, mixed.block_n, mixed.block_k, mixed.num_stages) == (256, 64, 64, 5)
    with pytest.raises(NotImplementedError, match="block_n >= 16 divides 40"):
        default_block_config(64, 4, 64, 40)


def test_group_row_bounds_include_the_tail():
    bounds = group_row_bounds(jnp.asarray((3, 0, 20, 9), jnp.int32), 30)
    np.testing.assert_array_equal(bounds, [0, 3, 3, 23, 30, 30])  # clipped to M, then M
    bounds = group_row_bounds(jnp.asarray((3, 0, 2), jnp.int32), 8)
    np.testing.assert_array_equal(bounds, [0, 3, 3, 5, 8])  # tail: rows 5..8


def test_default_is_the_reference_off_gpu(monkeypatch):
    monkeypatch.setattr(common, "kernel_platform", lambda: "cpu")
    lhs, rhs = operands()
    gs = jnp.asarray(GROUP_SIZES["middle_empty"], jnp.int32)
    _, ran = grouped_matmul_with_implementation(lhs, rhs, gs)
    assert ran is common.Implementation.XLA


def test_order_falls_back_when_pallas_cannot_tile():
    """N = 40 has no power-of-two block_n >= 16 dividing it: Pallas raises, XLA runs."""
    lhs, rhs = operands(n=40)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    with pytest.raises(NotImplementedError, match="block_n"):
        grouped_matmul(lhs, rhs, gs, implementation="pallas", interpret=True)
    out, ran = grouped_matmul_with_implementation(
        lhs, rhs, gs, implementation=("pallas", "xla"), out_dtype=jnp.float32
    )
    assert ran is common.Implementation.XLA
    assert_matches(out, lhs, rhs, GROUP_SIZES["empty_one_ragged"], exact_reference=True)


def test_no_rows():
    _, rhs = operands()
    empty = jnp.zeros((0, K), jnp.bfloat16)
    out = grouped_matmul(empty, rhs, jnp.zeros((G,), jnp.int32), implementation="pallas")
    assert out.shape == (0, N) and out.dtype == jnp.bfloat16


def test_bad_inputs_raise_clear_errors():
    lhs, rhs = operands()
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    run = functools.partial(grouped_matmul, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="contraction mismatch"):
        run(jnp.zeros((M, 2 * K), jnp.bfloat16), rhs, gs)
    with pytest.raises(ValueError, match=r"rhs must be \[G, N, K\]"):
        run(lhs, rhs[0], gs)
    with pytest.raises(ValueError, match=r"lhs must be \[M, K\]"):
        run(lhs[None], rhs, gs)
    with pytest.raises(ValueError, match="rhs dtype float32 must equal lhs dtype bfloat16"):
        run(lhs, rhs.astype(jnp.float32), gs)
    with pytest.raises(ValueError, match="lhs must be bfloat16, float16 or float32, got int32"):
        run(lhs.astype(jnp.int32), rhs.astype(jnp.int32), gs)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(G,\) = \(4,\)"):
        run(lhs, rhs, jnp.ones((G + 1,), jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must be int32, got float32"):
        run(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="block_n=64 must divide N=32"):
        run(lhs, rhs, gs, block_n=64)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got 24"):
        run(lhs, rhs, gs, block_m=24)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got 0"):
        BlockConfig(num_stages=0)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_h200():
    """The kernel lowers to Triton IR for an (abstract) H200; this does not compile or run it."""
    lhs, rhs = operands()
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    f = functools.partial(grouped_matmul_pallas, config=BlockConfig(**SMALL_TILES))
    assert_lowers_to_triton_for_h200(f, lhs, rhs, gs)
