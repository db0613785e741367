"""Grouped FP4 MoE matmul: every implementation against the float32 ragged_dot reference.

One test base runs the shared cases through the api with a given implementation; each implementation
is a short subclass. Shapes: M = 40 rows (not a multiple of block_m = 16), K = 64, N = 32, G = 4,
with ragged group sizes (an empty group, a group of one, sum < M so trailing rows must be 0).

Tolerance (outputs in float32): |out - ref| <= 1e-5 * (|a| @ |w|^T), per element, where |a|, |w| are
the dequantized magnitudes. Why: the kernel's float16 / bfloat16 operands are exact (an E2M1 or E4M3
code times its block scale fits its dot dtype; see kernel.py), so kernel and reference add the same
exact products in float32 and differ only by summation order, <= (K - 1) * 2**-24 ~ 3.8e-6 of the
sum of magnitudes, plus a few float32 roundings where the NVFP4 global scales are applied
(reference: per element, kernel: after the dot), ~2.4e-7. 1e-5 is over twice that bound; an error in
a scale or a code is far larger (a kernel without the weights' global scale, or with its nibbles
swapped, misses by ~5e7 times the bound). The "xla" implementation is the reference and must match
it bit for bit.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.extend import core as jax_core

from kernels_pallas.fp4_moe_matmul import (
    BlockConfig,
    MoEImplementation,
    PackedFP4Weights,
    api,
    default_block_config,
    dequantize_lhs,
    dequantize_weights,
    fp4_moe_matmul,
    fp4_moe_matmul_pallas,
    fp4_moe_matmul_reference,
    fp4_moe_matmul_with_implementation,
    implementation_order,
    pack_weights,
    scaled,
    tile_group_ranges,
)
from tests.kernels_pallas.triton_lowering import assert_lowers_to_triton_for_h200
from trace_jax import fp4

M, K, N, G = 40, 64, 32, 4
RTOL_OF_MAGNITUDE = 1e-5
GROUP_SIZES = {
    "empty_one_ragged": (0, 1, 25, 9),  # sum 35 < M; tiles straddle groups
    "middle_empty": (7, 0, 0, 30),
    "one_group_all_rows": (0, 0, 40, 0),
    "all_empty": (0, 0, 0, 0),
}
W_FORMATS = [fp4.NVFP4, fp4.MXFP4]
A_FORMATS = [None, fp4.MXFP4, fp4.NVFP4, fp4.MXFP8]  # None: bfloat16 activations
# The in-kernel decode's layouts beside the default (`kernel.BlockConfig`), each off until timed.
DECODE_LAYOUTS = [
    {"weights_left": True},
    {"split_by_scale_block": True},
    {"weights_left": True, "split_by_scale_block": True},
]


def _id(fmt) -> str:
    return "bf16" if fmt is None else fmt.name


@functools.cache
def _activations(a_fmt, m, k, seed):
    x = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32)
    if a_fmt is None:
        return x.astype(jnp.bfloat16)
    return jax.jit(fp4.quantize, static_argnums=1)(x, a_fmt)


@functools.cache
def _weights(w_fmt, n, k, seed):
    w = jax.random.normal(jax.random.key(seed + 1000), (G, n, k), jnp.float32)
    return jax.jit(pack_weights, static_argnums=1)(w, w_fmt)


def make_operands(w_fmt, a_fmt, *, m=M, k=K, n=N, seed=0):
    """Random normal activations `[m, k]` (bf16 or a QTensor) and packed weights `[G, n, k]`."""
    return _activations(a_fmt, m, k, seed), _weights(w_fmt, n, k, seed)


@jax.jit
def reference_and_magnitude(lhs, rhs, group_sizes):
    """The float32 reference and |a| @ |w|^T per group (the scale of float32 summation error)."""
    ref = fp4_moe_matmul_reference(lhs, rhs, group_sizes, out_dtype=jnp.float32)
    a = jnp.abs(dequantize_lhs(lhs))
    w = jnp.swapaxes(jnp.abs(dequantize_weights(rhs)), -1, -2)
    mag = jax.lax.ragged_dot(
        a, w, group_sizes, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return ref, mag


def assert_matches_reference(out, lhs, rhs, group_sizes, *, exact: bool):
    ref, mag = map(np.asarray, reference_and_magnitude(lhs, rhs, group_sizes))
    out = np.asarray(out)
    assert out.shape == ref.shape and out.dtype == np.float32
    if exact:
        np.testing.assert_array_equal(out, ref)
    else:
        bound = RTOL_OF_MAGNITUDE * mag
        err = np.abs(out - ref)
        worst = float(np.max(err / np.maximum(bound, 1e-30)))
        assert np.all(err <= bound), f"max |error| {err.max():.3g}, {worst:.3g} x the bound"
    total = int(np.sum(group_sizes))
    np.testing.assert_array_equal(out[total:], 0.0)  # rows past sum(group_sizes)


class _Cases:
    """Shared cases; a subclass sets `implementation` (and `exact` if it must equal the
    reference)."""

    implementation: ClassVar[str]
    exact: ClassVar[bool] = False
    tiling: ClassVar[dict] = {}

    def op(self, lhs, rhs, group_sizes, **kwargs):
        return fp4_moe_matmul(
            lhs, rhs, group_sizes, implementation=self.implementation, **self.tiling, **kwargs
        )

    @pytest.mark.parametrize("a_fmt", A_FORMATS, ids=_id)
    @pytest.mark.parametrize("w_fmt", W_FORMATS, ids=_id)
    def test_matches_reference(self, w_fmt, a_fmt):
        lhs, rhs = make_operands(w_fmt, a_fmt)
        run = jax.jit(lambda gs: self.op(lhs, rhs, gs, out_dtype=jnp.float32))  # one compile
        for sizes in GROUP_SIZES.values():
            gs = jnp.asarray(sizes, jnp.int32)
            assert_matches_reference(run(gs), lhs, rhs, gs, exact=self.exact)

    def test_bfloat16_output(self):
        lhs, rhs = make_operands(fp4.NVFP4, fp4.MXFP8)
        gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
        out = self.op(lhs, rhs, gs)
        assert out.dtype == jnp.bfloat16
        ref, mag = map(np.asarray, reference_and_magnitude(lhs, rhs, gs))
        # One bfloat16 rounding of the float32 result (2**-9 relative) on top of the f32 bound.
        bound = 2.0**-8 * np.abs(ref) + RTOL_OF_MAGNITUDE * mag
        assert np.all(np.abs(np.asarray(out, np.float32) - ref) <= bound)


class TestXla(_Cases):
    implementation = "xla"
    exact = True


class TestPallasInterpret(_Cases):
    """The row-tile grid."""

    implementation = "pallas"
    tiling: ClassVar[dict] = dict(
        block_m=16, block_n=16, block_k=32, grid="row_tiles", interpret=True
    )

    def test_fewer_rows_than_a_tile(self):
        """M = 10 < block_m = 16, one row past the groups."""
        lhs, rhs = make_operands(fp4.NVFP4, fp4.NVFP4, m=10, seed=3)
        gs = jnp.asarray((3, 0, 2, 4), jnp.int32)
        out = self.op(lhs, rhs, gs, out_dtype=jnp.float32)
        assert_matches_reference(out, lhs, rhs, gs, exact=False)

    def test_default_tiles(self):
        """Default tiles (group-major grid, row tiles of the mean group size, block_k = K)."""
        lhs, rhs = make_operands(fp4.NVFP4, fp4.NVFP4, seed=1)
        gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
        out = fp4_moe_matmul(
            lhs, rhs, gs, implementation="pallas", interpret=True, out_dtype=jnp.float32
        )
        assert_matches_reference(out, lhs, rhs, gs, exact=False)
        config = api.block_config(lhs, rhs)
        mean_rows = pl.next_power_of_2(pl.cdiv(lhs.shape[0], rhs.codes.shape[0]))
        assert config.grid == "groups"
        assert (config.block_m, config.block_n, config.block_k) == (max(16, mean_rows), 32, 64)
        config = api.block_config(lhs, rhs, grid="row_tiles")
        assert (config.block_m, config.block_n, config.block_k) == (64, 32, 64)

    def test_nan_block_stays_in_its_group(self):
        """A NaN weight block poisons only its own expert's rows.

        (The reference cannot be compared here: XLA's ragged_dot on the CPU computes masked dense
        products, so a NaN in one expert's weights leaks into every row of that output column.)
        """
        lhs, clean = make_operands(fp4.MXFP4, None)
        bits = jax.lax.bitcast_convert_type(clean.scales, jnp.uint8).at[2, 5, 0].set(0xFF)  # NaN
        rhs = PackedFP4Weights(
            clean.codes, jax.lax.bitcast_convert_type(bits, clean.fmt.scale_dtype), None, clean.fmt
        )
        gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)  # expert 2: rows 1..25
        out = np.asarray(self.op(lhs, rhs, gs, out_dtype=jnp.float32))
        expected_nan = np.zeros(out.shape, bool)
        expected_nan[1:26, 5] = True
        np.testing.assert_array_equal(np.isnan(out), expected_nan)
        ref, mag = map(np.asarray, reference_and_magnitude(lhs, clean, gs))
        # Other columns: the clean reference to summation order (the module docstring's bound).
        err = np.abs(np.delete(out, 5, 1) - np.delete(ref, 5, 1))
        assert np.all(err <= RTOL_OF_MAGNITUDE * np.delete(mag, 5, 1)), err.max()


class TestPallasInterpretGroupMajor(TestPallasInterpret):
    """The same cases on the (G, N / block_n) grid."""

    tiling: ClassVar[dict] = dict(block_m=16, block_n=16, block_k=32, grid="groups", interpret=True)

    def test_default_tiles(self):
        lhs, rhs = make_operands(fp4.NVFP4, fp4.NVFP4, seed=1)
        gs = jnp.asarray(GROUP_SIZES["middle_empty"], jnp.int32)
        tiling = self.tiling | {"block_m": None}  # default block_m (64 > every group here)
        out = fp4_moe_matmul(lhs, rhs, gs, implementation="pallas", out_dtype=jnp.float32, **tiling)
        assert_matches_reference(out, lhs, rhs, gs, exact=False)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("layout", [{}, *DECODE_LAYOUTS], ids=lambda d: "+".join(d) or "default")
@pytest.mark.parametrize("grid", ["row_tiles", "groups"])
@pytest.mark.parametrize(("w_fmt", "a_fmt"), [(fp4.NVFP4, fp4.NVFP4), (fp4.MXFP4, fp4.MXFP8)])
def test_lowers_to_triton_for_h200(w_fmt, a_fmt, grid, layout):
    """The kernel lowers to Triton IR for an (abstract) H200; this does not compile or run it."""
    lhs, rhs = make_operands(w_fmt, a_fmt)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    config = BlockConfig(block_m=16, block_n=16, block_k=32, grid=grid, **layout)
    f = functools.partial(fp4_moe_matmul_pallas, config=config)
    assert_lowers_to_triton_for_h200(f, lhs, rhs, gs)


def _pallas_call_operands(jaxpr, skip: tuple[str, ...] = ()) -> list:
    """Abstract values of the operands of the one `pallas_call` inside `jaxpr` (nested jits
    included) not named in `skip`."""
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call" and eqn.params["name"] not in skip:
                found.append([v.aval for v in eqn.invars])
            for param in eqn.params.values():
                if isinstance(param, jax_core.Jaxpr):
                    walk(param)

    walk(jaxpr)
    assert len(found) == 1, f"expected one pallas_call, found {len(found)}"
    return found[0]


@pytest.mark.parametrize(
    ("grid", "w_fmt", "a_fmt", "dot_dtype"),
    [
        ("row_tiles", fp4.NVFP4, fp4.NVFP4, jnp.float16),
        ("groups", fp4.MXFP4, fp4.MXFP8, jnp.bfloat16),
    ],
)
def test_kernel_reads_decoded_activation_planes(grid, w_fmt, a_fmt, dot_dtype):
    """Quantized activations enter the kernel decoded once, before the call: two `[M, K / 2]`
    planes in the dot's dtype (and NVFP4's per-row float32 global scale), neither codes nor
    block-scale bits, which every N tile's program would decode again."""
    lhs, rhs = make_operands(w_fmt, a_fmt)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    config = BlockConfig(block_m=16, block_n=16, block_k=32, grid=grid)
    jaxpr = jax.make_jaxpr(functools.partial(fp4_moe_matmul_pallas, config=config))(lhs, rhs, gs)
    per_row = [(a.shape, a.dtype) for a in _pallas_call_operands(jaxpr) if a.shape[0] == M]
    expected = [((M, K // 2), jnp.dtype(dot_dtype))] * 2
    expected += [((M,), jnp.dtype(jnp.float32))] * a_fmt.has_global_scale
    assert per_row == expected


def _wide_range(shape, fmt, seed):
    """float32 normal values whose blocks along the last axis span many binades: NVFP4 blocks
    2**-20..1 (block scales across E4M3's range, subnormals and flushes included), others
    2**-40..2**40 (E8M0 scales and bf16 values past float16's range both ways)."""
    block = 16 if fmt is None else fmt.block_size
    lo, hi = (-20, 0) if fmt is not None and fmt.has_global_scale else (-40, 40)
    k_exp, k_val = jax.random.split(jax.random.key(seed))
    exps = jax.random.randint(k_exp, (*shape[:-1], shape[-1] // block), lo, hi + 1)
    scale = jnp.exp2(jnp.repeat(exps, block, axis=-1).astype(jnp.float32))
    return jax.random.normal(k_val, shape, jnp.float32) * scale


WIDE_RANGE_FORMATS = [(fp4.NVFP4, None), (fp4.NVFP4, fp4.NVFP4), (fp4.MXFP4, fp4.MXFP8)]


@pytest.mark.parametrize(("w_fmt", "a_fmt"), WIDE_RANGE_FORMATS, ids=_id)
def test_operands_across_their_formats_range(w_fmt, a_fmt):
    """Every decoded operand stays exact in the kernel's dot dtype (float16 for NVFP4 x NVFP4,
    bfloat16 otherwise) from the bottom to the top of its format's range, so the product still
    matches the reference to float32 summation: a float16 operand that cannot hold a bf16 value,
    an E8M0 scale or an E4M3 subnormal scale (inf, 0 or rounded) misses by far more."""
    x = _wide_range((M, K), a_fmt, seed=5)
    lhs = x.astype(jnp.bfloat16) if a_fmt is None else fp4.quantize(x, a_fmt)
    rhs = pack_weights(_wide_range((G, N, K), w_fmt, seed=6), w_fmt)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    tiling = dict(block_m=16, block_n=16, block_k=32, grid="groups", interpret=True)
    out = fp4_moe_matmul(lhs, rhs, gs, implementation="pallas", out_dtype=jnp.float32, **tiling)
    assert_matches_reference(out, lhs, rhs, gs, exact=False)


def test_tile_group_ranges_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        m, block_m = int(rng.integers(1, 80)), int(rng.choice([16, 32]))
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(5) / 5) * rng.integers(0, 2, 5)
        bounds, first, end = map(
            np.asarray, tile_group_ranges(jnp.asarray(sizes, jnp.int32), m, block_m)
        )
        np.testing.assert_array_equal(bounds, np.concatenate([[0], np.cumsum(sizes)]))
        for i in range(len(first)):
            rows = set(range(i * block_m, min((i + 1) * block_m, m)))
            touching = {g for g in range(5) if rows & set(range(bounds[g], bounds[g + 1]))}
            visited = set(range(first[i], end[i]))
            assert touching <= visited
            assert all(sizes[g] == 0 for g in visited - touching)  # only empty extras


def test_default_block_config_by_phase():
    """Row tiles follow the group sizes; decode takes long K steps, prefill 128-deep ones;
    quantized activations take wider N tiles; explicit values stand, missing ones are filled in."""
    decode = default_block_config(512, 128, 2048, 768)
    assert (decode.block_m, decode.block_n, decode.block_k, decode.grid) == (16, 64, 256, "groups")
    assert default_block_config(512, 128, 2048, 768, lhs_fmt=fp4.NVFP4).block_n == 128
    prefill = default_block_config(65536, 128, 2048, 768)
    assert (prefill.block_m, prefill.block_n, prefill.block_k) == (256, 128, 128)
    prefill = default_block_config(65536, 128, 2048, 768, lhs_fmt=fp4.NVFP4)
    assert (prefill.block_m, prefill.block_n, prefill.block_k) == (128, 256, 128)
    assert default_block_config(64, 4, 32, 16).block_k == 32  # shrunk to K, two 16-deep planes
    lhs, rhs = make_operands(fp4.NVFP4, fp4.MXFP8)
    config = api.block_config(lhs, rhs, num_warps=8, block_n=16)
    assert (config.block_m, config.block_n, config.block_k, config.num_warps) == (16, 16, 64, 8)


def test_default_is_the_reference_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("checks the CPU choice")
    assert implementation_order(None) == (MoEImplementation.XLA,)
    assert implementation_order("pallas") == (MoEImplementation.PALLAS,)
    assert implementation_order(("scaled_matmul", "xla")) == (
        MoEImplementation.SCALED_MATMUL,
        MoEImplementation.XLA,
    )
    with pytest.raises(ValueError, match="got 'auto'"):
        implementation_order("auto")
    lhs, rhs = make_operands(fp4.MXFP4, fp4.MXFP4)
    gs = jnp.asarray(GROUP_SIZES["middle_empty"], jnp.int32)
    out, ran = fp4_moe_matmul_with_implementation(lhs, rhs, gs, out_dtype=jnp.float32)
    assert ran is MoEImplementation.XLA
    assert_matches_reference(out, lhs, rhs, gs, exact=True)


SAME_BLOCKS = [(fp4.NVFP4, fp4.NVFP4), (fp4.MXFP4, fp4.MXFP4), (fp4.MXFP4, fp4.MXFP8)]


@pytest.mark.parametrize("tile", [None, 16, 64])
@pytest.mark.parametrize(("w_fmt", "a_fmt"), SAME_BLOCKS, ids=lambda f: f.name)
def test_scaled_matmul_implementation_matches_reference(w_fmt, a_fmt, tile):
    """`jax.nn.scaled_matmul` over per-group row tiles (XLA's decomposition on the CPU); a GPU
    without native block-scaled matmul (compute capability < 10, e.g. the H200) refuses it."""
    lhs, rhs = make_operands(w_fmt, a_fmt)
    run = jax.jit(
        lambda gs: fp4_moe_matmul(
            lhs, rhs, gs, implementation="scaled_matmul", block_m=tile, out_dtype=jnp.float32
        )
    )
    device = jax.devices()[0]
    if device.platform == "gpu" and float(getattr(device, "compute_capability", 0)) < 10:
        with pytest.raises(NotImplementedError, match="compute capability >= 10"):
            run(jnp.asarray(GROUP_SIZES["middle_empty"], jnp.int32))
        return
    for sizes in GROUP_SIZES.values():
        gs = jnp.asarray(sizes, jnp.int32)
        assert_matches_reference(run(gs), lhs, rhs, gs, exact=False)


def test_scaled_matmul_unsupported_operands_raise():
    gs = jnp.asarray(GROUP_SIZES["middle_empty"], jnp.int32)
    lhs, rhs = make_operands(fp4.NVFP4, None)
    with pytest.raises(NotImplementedError, match="block-scaled"):
        fp4_moe_matmul(lhs, rhs, gs, implementation="scaled_matmul")
    lhs, rhs = make_operands(fp4.NVFP4, fp4.MXFP8)
    with pytest.raises(NotImplementedError, match="equal scale blocks"):
        fp4_moe_matmul(lhs, rhs, gs, implementation="scaled_matmul")


def test_scaled_matmul_tile_plan_brute_force():
    # Traced as the matmul traces it: one compile per (M, tile, G), not one per operation.
    tile_plan = jax.jit(scaled.tile_plan, static_argnums=(1, 2))
    rng = np.random.default_rng(1)
    for _ in range(30):
        m, tile, g = int(rng.integers(1, 70)), int(rng.choice([16, 32])), int(rng.integers(1, 6))
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g)
        sizes = sizes * rng.integers(0, 2, g)
        rows, group = map(np.asarray, tile_plan(jnp.asarray(sizes, jnp.int32), m, tile))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        seen = {}
        for b in range(rows.shape[0]):
            for r in rows[b][rows[b] < m]:
                assert r not in seen, "a row in two tiles"
                seen[int(r)] = int(group[b])
        # Every grouped row appears once, in a tile of its own group; no other row appears.
        expected = {r: gi for gi in range(g) for r in range(starts[gi], starts[gi] + sizes[gi])}
        assert seen == expected


def test_order_falls_back_when_pallas_cannot_tile():
    """N = 40 has no power-of-two block_n >= 16 dividing it: Pallas raises, XLA runs (and before
    it scaled_matmul refuses bf16 activations)."""
    lhs, rhs = make_operands(fp4.NVFP4, None, n=40)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    with pytest.raises(NotImplementedError, match="block_n"):
        fp4_moe_matmul(lhs, rhs, gs, implementation="pallas", interpret=True)
    order = ("scaled_matmul", "pallas", "xla")
    out, ran = fp4_moe_matmul_with_implementation(
        lhs, rhs, gs, implementation=order, interpret=True, out_dtype=jnp.float32
    )
    assert ran is MoEImplementation.XLA
    assert_matches_reference(out, lhs, rhs, gs, exact=True)


def test_no_rows():
    _, rhs = make_operands(fp4.NVFP4, None)
    out = fp4_moe_matmul(
        jnp.zeros((0, K), jnp.bfloat16),
        rhs,
        jnp.zeros((G,), jnp.int32),
        implementation="pallas",
        interpret=True,
    )
    assert out.shape == (0, N) and out.dtype == jnp.bfloat16


def test_bad_inputs_raise_clear_errors():
    lhs, rhs = make_operands(fp4.NVFP4, fp4.MXFP4)
    gs = jnp.asarray(GROUP_SIZES["empty_one_ragged"], jnp.int32)
    run = functools.partial(fp4_moe_matmul, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="contraction mismatch"):
        run(jnp.zeros((M, 2 * K), jnp.bfloat16), rhs, gs)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(G,\)"):
        run(lhs, rhs, jnp.ones((G + 1,), jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must be int32"):
        run(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="must be bfloat16"):
        run(jnp.zeros((M, K), jnp.float32), rhs, gs)
    with pytest.raises(ValueError, match=r"lhs must be \[M, K\]"):
        run(jnp.zeros((2, M, K), jnp.bfloat16), rhs, gs)
    bad_codes = PackedFP4Weights(rhs.codes.astype(jnp.int8), rhs.scales, rhs.global_scale, rhs.fmt)
    with pytest.raises(ValueError, match="codes must be uint8"):
        run(lhs, bad_codes, gs)
    per_row = PackedFP4Weights(rhs.codes, rhs.scales, jnp.ones((G, N, 1)), rhs.fmt)
    with pytest.raises(ValueError, match="one value per expert"):
        run(lhs, per_row, gs)
    with pytest.raises(TypeError, match="PackedFP4Weights"):
        run(lhs, dequantize_weights(rhs), gs)
    with pytest.raises(ValueError, match="FP4"):
        pack_weights(jnp.ones((G, N, K)), fp4.MXFP8)
    # K not a multiple of the format's block size.
    with pytest.raises(ValueError, match="multiple of the block size"):
        pack_weights(jnp.ones((G, N, 40)), fp4.NVFP4)
    # Tiles that do not fit the operands.
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32"):
        run(lhs, rhs, gs, block_k=16)
    with pytest.raises(ValueError, match="block_n=64 must divide N=32"):
        run(lhs, rhs, gs, block_n=64)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        run(lhs, rhs, gs, block_m=24)


@pytest.mark.parametrize("layout", DECODE_LAYOUTS, ids=lambda d: "+".join(d))
@pytest.mark.parametrize("grid", ["row_tiles", "groups"])
@pytest.mark.parametrize(("w_fmt", "a_fmt"), [(fp4.NVFP4, fp4.NVFP4), (fp4.MXFP4, None)], ids=_id)
def test_decode_layouts_give_the_same_product(grid, w_fmt, a_fmt, layout):
    """`weights_left` (the decoded weights as each tile dot's left operand, the accumulator
    transposed) and `split_by_scale_block` (the codes read as `[block_n, block_k / bs, bs / 2]`,
    the scales broadcast per block) compute the reference's product on either grid, empty and
    ragged groups included; the settings are validated."""
    lhs, rhs = make_operands(w_fmt, a_fmt, seed=3)
    tiling = dict(block_m=16, block_n=16, block_k=32, grid=grid, **layout)
    for sizes in GROUP_SIZES.values():
        gs = jnp.asarray(sizes, jnp.int32)
        out = fp4_moe_matmul(
            lhs, rhs, gs, implementation="pallas", interpret=True, out_dtype=jnp.float32, **tiling
        )
        assert_matches_reference(out, lhs, rhs, gs, exact=False)
    config = api.block_config(lhs, rhs, **layout)
    assert all(getattr(config, flag) == value for flag, value in layout.items())
    assert not api.block_config(lhs, rhs).weights_left
    assert not api.block_config(lhs, rhs).split_by_scale_block
    with pytest.raises(ValueError, match="weights_left must be a bool"):
        BlockConfig(weights_left=1)
    with pytest.raises(ValueError, match="split_by_scale_block must be a bool"):
        BlockConfig(split_by_scale_block="yes")
