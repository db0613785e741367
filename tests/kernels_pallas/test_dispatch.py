"""Where and how each kernel op runs (`kernels_pallas.common.pallas_target`), through its api.

On the CPU: an explicit "pallas" without interpretation raises, naming the platform; the default
runs the XLA reference; ("pallas", "xla") falls through to it. `interpret=True` (or the
`interpreting` context) runs the Triton kernel interpreted, `pltpu.InterpretParams` the Mosaic
one. Every Triton kernel lowers for an H200 and a B200, and `lowering_for("tpu")` selects the
Mosaic kernels, which lower to a `tpu_custom_call` (the real Mosaic passes, on the CPU).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import common
from kernels_pallas.common import Implementation, Lowering, PallasUnavailableError
from kernels_pallas.fp4_decode_attention import api as attention_api
from kernels_pallas.fp4_decode_attention import (
    bf16_decode_attention,
    bf16_decode_attention_plan,
    fp4_decode_attention,
    fp4_decode_attention_plan,
)
from kernels_pallas.fp4_decode_attention import mosaic as attention_mosaic
from kernels_pallas.fp4_moe_matmul import api as moe_api
from kernels_pallas.fp4_moe_matmul import fp4_moe_matmul_with_implementation, pack_weights
from kernels_pallas.fp4_moe_matmul import mosaic as moe_mosaic
from kernels_pallas.fp4_quantize import api as quantize_api
from kernels_pallas.fp4_quantize import (
    fp4_quantize_with_implementation,
    quantize_capture_reference,
)
from kernels_pallas.fp4_quantize import mosaic as quantize_mosaic
from kernels_pallas.grouped_matmul import (
    grouped_matmul_megablox,
    grouped_matmul_reference,
    grouped_matmul_with_implementation,
    megablox_tiling,
)
from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache

GROUP_SIZES = (20, 0, 9)  # an empty group; rows 29..31 belong to none
# One worker runs the module: its tests share the operands and their compiled references.
pytestmark = pytest.mark.xdist_group("dispatch")


def _x(shape, seed=0, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.fixture(scope="module")
def operands():
    """Tiny operands of every op (Mosaic-sized: 128-lane N and K, Dh = 128)."""
    b, s, hkv, dh = 2, 256, 2, 128
    k_cache = PackedTensorCache.empty((b, s, hkv, dh), fp4.NVFP4)
    kv = jnp.zeros((b, s, hkv, dh), jnp.bfloat16)
    return {
        "x": _x((16, 256)),
        "lhs": _x((32, 256), seed=1),
        "weights": pack_weights(_x((3, 128, 256), seed=2, dtype=jnp.float32), fp4.NVFP4),
        "rhs": _x((3, 128, 256), seed=3),
        "group_sizes": jnp.asarray(GROUP_SIZES, jnp.int32),
        "q": _x((b, 8, dh), seed=4),
        "cache": k_cache,
        "kv": kv,
        "lengths": jnp.asarray([200, 256], jnp.int32),
    }


def _ops(o):
    """name -> f(implementation, **kw) -> (output, what ran) for every op."""

    def attention(impl, **kw):
        plan = fp4_decode_attention_plan(o["q"], o["cache"], o["cache"], o["lengths"], **kw,
                                         implementation=impl)  # fmt: skip
        return fp4_decode_attention(
            o["q"], o["cache"], o["cache"], o["lengths"], implementation=impl, **kw
        ), plan.implementation

    def bf16_attention(impl, **kw):
        plan = bf16_decode_attention_plan(o["q"], o["kv"], o["kv"], o["lengths"], **kw,
                                          implementation=impl)  # fmt: skip
        out = bf16_decode_attention(o["q"], o["kv"], o["kv"], o["lengths"], implementation=impl,
                                    **kw)  # fmt: skip
        return out, plan.implementation

    return {
        "quantize": lambda impl, **kw: fp4_quantize_with_implementation(
            o["x"], fp4.NVFP4, implementation=impl, **kw
        ),
        "fp4_moe_matmul": lambda impl, **kw: fp4_moe_matmul_with_implementation(
            o["lhs"], o["weights"], o["group_sizes"], implementation=impl, **kw
        ),
        "grouped_matmul": lambda impl, **kw: grouped_matmul_with_implementation(
            o["lhs"], o["rhs"], o["group_sizes"], implementation=impl, **kw
        ),
        "fp4_decode_attention": attention,
        "bf16_decode_attention": bf16_attention,
    }


def test_on_the_cpu_pallas_needs_interpretation_and_the_default_is_xla(operands):
    with common.lowering_for("cpu"):
        for name, op in _ops(operands).items():
            with pytest.raises(PallasUnavailableError, match="platform 'cpu'") as e:
                op("pallas")
            assert "interpret=True" in str(e.value), name
            assert op(None)[1] == "xla", name
            assert op(("pallas", "xla"))[1] == "xla", name
        plan = fp4_decode_attention_plan(
            operands["q"], operands["cache"], operands["cache"], operands["lengths"],
            implementation=("pallas", "xla"),
        )  # fmt: skip
        assert plan.lowering is None and "platform 'cpu'" in plan.fallback


def _lower(fn, platform: str) -> tuple[str, list]:
    """The lowered text of `fn()` for `platform` ("cuda" | "tpu") and what each op reported."""
    ran = []

    def traced():
        out, name = fn()
        ran.append(name)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        lowered = jax.jit(traced).trace().lower(lowering_platforms=(platform,))
    return lowered.as_text(), ran


@pytest.mark.parametrize("gpu", ["H200", "B200"])
def test_every_triton_kernel_lowers_for_hopper_and_blackwell(triton_lowering, operands, gpu):
    """Quantize (the row-loop and column-tile launches, RTN and guided), the FP4 MoE matmul (bf16
    and NVFP4 activations) and the bf16 grouped matmul, natively on a GPU through their apis.
    (The decode-attention kernels: `test_fp4_decode_attention`.)"""
    version = plgpu.GpuVersion[gpu]
    triton_lowering(version)
    o = operands
    wide = _x((8, 4096))
    guided = fp4.make_guidance(fp4.quantize(_x((8, 2048), seed=5), fp4.MXFP4), "compact")
    pallas = dict(implementation="pallas")
    cases = {
        "quantize nvfp4 row loop": lambda: fp4_quantize_with_implementation(
            wide, fp4.NVFP4, **pallas
        ),
        "quantize mxfp4 guided column tiles": lambda: fp4_quantize_with_implementation(
            _x((8, 2048), seed=5), fp4.MXFP4, guidance=guided, **pallas
        ),
        "fp4_moe_matmul bf16": lambda: fp4_moe_matmul_with_implementation(
            o["lhs"], o["weights"], o["group_sizes"], **pallas
        ),
        "fp4_moe_matmul nvfp4": lambda: fp4_moe_matmul_with_implementation(
            fp4.quantize(o["lhs"], fp4.NVFP4), o["weights"], o["group_sizes"], **pallas
        ),
        "grouped_matmul": lambda: grouped_matmul_with_implementation(
            o["lhs"], o["rhs"], o["group_sizes"], **pallas
        ),
    }
    for name, fn in cases.items():
        triton_lowering.queried.clear()
        text, ran = _lower(fn, "cuda")
        assert "__gpu$xla.gpu.triton" in text and "tpu_custom_call" not in text, name
        assert ran == [Implementation.PALLAS] and triton_lowering.queried, name
        assert set(triton_lowering.queried) == {version}, name


MOSAIC_OPS = ["quantize", "fp4_moe_matmul", "grouped_matmul", "fp4_decode_attention"]


@pytest.mark.parametrize("name", MOSAIC_OPS)
def test_lowering_for_a_tpu_selects_the_mosaic_kernel(operands, name):
    """The default on a TPU is Pallas through Mosaic: the lowered program holds a Mosaic custom
    call and no Triton one."""
    op = _ops(operands)[name]
    with common.lowering_for("tpu"):
        text, ran = _lower(lambda: op(None), "tpu")
    assert "tpu_custom_call" in text and "gpu.triton" not in text
    assert ran == [Implementation.PALLAS]


def test_the_bf16_twin_runs_xla_on_a_tpu(operands):
    o = operands
    with common.lowering_for("tpu"):
        args = (o["q"], o["kv"], o["kv"], o["lengths"])
        plan = bf16_decode_attention_plan(*args)
        assert plan.implementation is Implementation.XLA and "no Mosaic kernel" in plan.fallback
        with pytest.raises(NotImplementedError, match="no Mosaic kernel"):
            bf16_decode_attention_plan(
                o["q"], o["kv"], o["kv"], o["lengths"], implementation="pallas"
            )
        plan = fp4_decode_attention_plan(o["q"], o["cache"], o["cache"], o["lengths"])
    assert (plan.implementation, plan.lowering, plan.interpret) == (
        Implementation.PALLAS, Lowering.MOSAIC, None,
    )  # fmt: skip
    assert plan.then == (Implementation.XLA,)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records each kernel function an api calls (Triton or Mosaic) with its `interpret=`, and
    returns zeros of the right shape instead of running it."""
    calls = []

    def spy(owner, attr, result):
        def record(*args, **kwargs):
            calls.append((attr, kwargs["interpret"]))
            return result(*args, **kwargs)

        monkeypatch.setattr(owner, attr, record)

    def quantized(x, fmt, **_):
        r, n = x.shape
        u8 = jnp.uint8
        return (jnp.zeros((r, n // 2), u8), jnp.zeros((r, n // fmt.block_size), u8),
                jnp.zeros((r, n // 8), u8), jnp.ones((r, 1), jnp.float32))  # fmt: skip

    def matmul(lhs, rhs, group_sizes, **_):
        return jnp.zeros((lhs.shape[0], rhs.shape[1]), jnp.bfloat16)

    def attention(q, *_, **__):
        return jnp.zeros_like(q)

    spy(quantize_mosaic, "quantize_capture_mosaic", quantized)
    spy(quantize_api, "quantize_capture_pallas", quantized)

    spy(moe_mosaic, "fp4_moe_matmul_mosaic", matmul)
    spy(moe_api, "fp4_moe_matmul_pallas", matmul)
    spy(attention_mosaic, "fp4_decode_attention_mosaic", attention)
    spy(attention_api.kernel, "fp4_decode_attention_pallas", attention)
    return calls


def test_interpretation_picks_the_kernel_and_reaches_it(operands, kernel_calls):
    """True -> the Triton kernel with interpret=True; InterpretParams -> the Mosaic kernel with
    those params; the `interpreting` context stands in for an op called without `interpret=`."""
    params = pltpu.InterpretParams(uninitialized_memory="zero")
    ops = _ops(operands)
    triton = ["quantize_capture_pallas", "fp4_moe_matmul_pallas", "fp4_decode_attention_pallas"]
    mosaic = ["quantize_capture_mosaic", "fp4_moe_matmul_mosaic", "fp4_decode_attention_mosaic"]
    names = ("quantize", "fp4_moe_matmul", "fp4_decode_attention")
    with common.lowering_for("cpu"):
        for interpret, kernels in ((True, triton), (params, mosaic)):
            for context in (False, True):
                kernel_calls.clear()
                for name in names:
                    if context:
                        with common.interpreting(interpret):
                            _, ran = ops[name]("pallas")
                    else:
                        _, ran = ops[name]("pallas", interpret=interpret)
                    assert ran == "pallas"
                assert kernel_calls == [(k, interpret) for k in kernels]


def test_megablox_grouped_matmul_matches_the_reference():
    """jax's megablox `gmm` (the TPU grouped matmul) in the TPU interpreter: an empty group, rows
    past sum(group_sizes) zero (megablox leaves them unwritten), M padded to a row tile; bf16
    products are exact in float32, so only the summation order differs (K = 256 terms)."""
    lhs, rhs = _x((30, 256), seed=6), _x((3, 128, 256), seed=7)
    gs = jnp.asarray(GROUP_SIZES, jnp.int32)
    params = pltpu.InterpretParams(uninitialized_memory="nan")  # unwritten rows would be NaN
    out, ran = grouped_matmul_with_implementation(
        lhs, rhs, gs, implementation="pallas", interpret=params, out_dtype=jnp.float32
    )
    assert ran is Implementation.PALLAS and out.shape == (30, 128)
    want = np.asarray(grouped_matmul_reference(lhs, rhs, gs, out_dtype=jnp.float32))
    got = np.asarray(out)
    np.testing.assert_array_equal(got[29:], 0.0)
    scale = np.abs(np.asarray(lhs, np.float32)) @ np.abs(np.asarray(rhs[0], np.float32)).T
    np.testing.assert_allclose(got, want, rtol=0, atol=256 * 2**-24 * float(scale.max()))
    assert megablox_tiling(30, 256, 128, jnp.bfloat16) == (32, 128, 128)
    assert megablox_tiling(500, 100, 640, jnp.float32) == (128, 100, 128)
    with pytest.raises(ValueError, match="block_m=24 must be a multiple of 16"):
        megablox_tiling(30, 256, 128, jnp.bfloat16, block_m=24)
    with pytest.raises(ValueError, match="block_n=64 must be a multiple of 128 or equal 256"):
        megablox_tiling(30, 256, 256, jnp.bfloat16, block_n=64)
    with pytest.raises(NotImplementedError, match="float16"):
        grouped_matmul_megablox(
            lhs.astype(jnp.float16), rhs.astype(jnp.float16), gs, tiling=(16, 128, 128)
        )


def test_mosaic_quantize_through_the_api_equals_the_reference():
    """The api's row flattening and padding (15 rows -> one 16-row program) and its guidance
    plumbing around the Mosaic kernel, in the TPU interpreter: bit for bit the reference."""
    x = _x((3, 5, 128), seed=8)
    guided = fp4.make_guidance(fp4.quantize(x * 1.01, fp4.NVFP4), "compact")
    for guidance in (None, guided):
        out = fp4_quantize_with_implementation(
            x, fp4.NVFP4, guidance=guidance, implementation="pallas",
            interpret=pltpu.InterpretParams(),
        )  # fmt: skip
        assert out[1] == "pallas"
        want = quantize_capture_reference(x, fp4.NVFP4, guidance=guidance)
        for got, ref in zip(jax.tree.leaves(out[0]), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    with pytest.raises(ValueError, match="Mosaic quantize kernel takes whole rows"):
        fp4_quantize_with_implementation(
            x, fp4.NVFP4, implementation="pallas", block_n=64, interpret=pltpu.InterpretParams()
        )
