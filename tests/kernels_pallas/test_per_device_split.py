"""The Triton kernels on a data-parallel mesh: each device runs its own rows (`common.per_device`).

GSPMD cannot partition a Pallas custom call: left to it, a kernel gets all-gathered operands and
runs on the full batch on every device (the decode attention gathering the whole packed KV cache
every layer every step). The apis wrap every Pallas lowering, Triton included, in a shard_map
over the context mesh (`jax.set_mesh`) that splits independent rows over the devices.

Here the Triton kernels run in Pallas' generic interpreter (`interpret=True`: Triton semantics on
the CPU) inside `jax.jit` on a 2-device `data` mesh, inputs split by rows: the results equal the
unsharded call bit for bit, and the compiled program moves no data between devices. Left to
GSPMD, the interpreted kernel's grid loop slices sharded operands and the compiled program
gathers them. The grouped matmuls (groups span all rows) run whole on each device, bit for bit.
Two tests lower for CUDA (Triton IR for an abstract H200, `h200_triton_lowering`) on the mesh:
the decode attention, its Triton call inside the shard_map with no collective around it, and the
whole FP4 rollout (`generate`), every Triton call inside a shard_map.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.fp4_decode_attention import bf16_decode_attention, fp4_decode_attention
from kernels_pallas.fp4_moe_matmul import fp4_moe_matmul, pack_weights
from kernels_pallas.fp4_quantize import fp4_quantize
from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.prefill_attention import prefill_attention
from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache
from trace_jax.rl.sharding import make_mesh
from trace_jax.rollout.collectives import hlo_collectives

pytestmark = pytest.mark.xdist_group("per_device_split")

B, S, HKV, G, DH = 4, 64, 2, 2, 64
LENGTHS = np.asarray([64, 1, 33, 50], np.int32)


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py)")
    return make_mesh(2)  # data 2 (fsdp, expert 1): the data-parallel rollout's mesh


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def _packed(x, fmt) -> PackedTensorCache:
    b, s = x.shape[:2]
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    return PackedTensorCache.empty(x.shape, fmt).write(fp4.quantize(x, fmt), slots)


def _quantize(x, guidance=None):
    return fp4_quantize(x, fp4.NVFP4, guidance=guidance, implementation="pallas", interpret=True)


def _guided_quantize_args():
    """x [B, 3, 128] and the rollout's compact guidance with one per-tensor global scale (
    [1, 1, 1]: the api broadcasts it to one per row before the split)."""
    x = _normal(10, (B, 3, 128), jnp.bfloat16)
    noise = _normal(11, x.shape)
    g = fp4.make_guidance(fp4.quantize(x.astype(jnp.float32) * (1 + 0.02 * noise), fp4.NVFP4))
    return x, dataclasses.replace(g, global_scale=jnp.max(g.global_scale).reshape(1, 1, 1))


def _fp4_decode(q, k, v, lengths):
    return fp4_decode_attention(
        q, k, v, lengths, implementation="pallas", interpret=True, block_s=32, k_splits=2
    )


def _bf16_decode(q, k, v, lengths):
    return bf16_decode_attention(
        q, k, v, lengths, implementation="pallas", interpret=True, block_s=32, k_splits=2
    )


def _prefill(q, k, v, positions, kv_lengths):
    return prefill_attention(
        q, k, v, positions, kv_lengths, implementation="pallas", interpret=True,
        block_r=16, block_s=16,
    )  # fmt: skip


def _row_split_cases():
    """(name, fn, args): ops whose operands all lead with independent rows."""
    k, v = _normal(2, (B, S, HKV, DH)), _normal(3, (B, S, HKV, DH))
    q = _normal(1, (B, HKV * G, DH), jnp.bfloat16)
    lengths = jnp.asarray(LENGTHS)
    t = 8
    positions = jnp.asarray(np.stack([np.arange(t) + 3 * i for i in range(B)]), jnp.int32)
    k_packed, v_packed = _packed(k, fp4.NVFP4), _packed(v, fp4.NVFP4)
    k_bf16, v_bf16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    prefill = (
        _normal(4, (B, t, HKV, G, 32)),
        _normal(5, (B, S, HKV, 32)),
        _normal(6, (B, S, HKV, 32)),
        positions,
        jnp.asarray([9, 17, 64, 40], jnp.int32),
    )
    return [
        ("fp4_quantize", _quantize, (_normal(0, (B, 3, 128), jnp.bfloat16),)),
        ("fp4_quantize_guided", _quantize, _guided_quantize_args()),
        ("fp4_decode_attention", _fp4_decode, (q, k_packed, v_packed, lengths)),
        ("bf16_decode_attention", _bf16_decode, (q, k_bf16, v_bf16, lengths)),
        ("prefill_attention", _prefill, prefill),
    ]


CASES = {name: (fn, args) for name, fn, args in _row_split_cases()}


def _rows(mesh, tree):
    """Every array split by its leading axis over "data" (broadcast ones replicated)."""
    return jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P("data") if a.shape[:1] == (B,) else P())),
        tree,
    )


def _assert_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("name", CASES)
def test_triton_kernel_runs_on_each_devices_rows(mesh, name):
    """Bit for bit the unsharded call, outputs split by rows, no collective in the program."""
    fn, args = CASES[name]
    want = jax.jit(fn)(*args)
    with jax.set_mesh(mesh):
        sharded = _rows(mesh, args)
        f = jax.jit(fn)
        got = f(*sharded)
        hlo = f.lower(*sharded).compile().as_text()
    found = sorted({c.op for c in hlo_collectives(hlo)})
    assert not found, f"{name}: the compiled program moves rows between devices: {found}"
    _assert_equal(got, want)
    for leaf in jax.tree.leaves(got):
        assert tuple(leaf.sharding.spec)[:1] in {("data",), (("data",),)}, leaf.sharding


def test_grouped_matmuls_run_whole_on_each_device(mesh):
    """Groups span all rows: each device runs the whole grouped matmul (`per_device` without a
    split), bit for bit the unsharded call, bf16 and FP4 weights."""
    m, kd, n, g = 40, 64, 32, 4
    lhs = _normal(7, (m, kd), jnp.bfloat16)
    sizes = jnp.asarray([0, 11, 25, 4], jnp.int32)
    bf16 = functools.partial(grouped_matmul, implementation="pallas", interpret=True)
    packed = jax.jit(pack_weights, static_argnums=1)(_normal(8, (g, n, kd)), fp4.NVFP4)

    def fp4_mm(lhs, rhs, sizes):
        return fp4_moe_matmul(lhs, rhs, sizes, implementation="pallas", interpret=True)

    for fn, rhs in ((bf16, _normal(9, (g, n, kd), jnp.bfloat16)), (fp4_mm, packed)):
        want = jax.jit(fn)(lhs, rhs, sizes)
        with jax.set_mesh(mesh):
            got = jax.jit(fn)(_rows(mesh, lhs), rhs, sizes)
        _assert_equal(got, want)


def test_decode_attention_lowers_for_cuda_inside_the_shard_map(mesh, h200_triton_lowering):
    """The native path (Triton IR for an H200, lowered on this CPU) on the mesh: the packed
    cache and the query stay split by rows, the Triton call inside the shard_map."""
    from jax.experimental.pallas import triton as plgpu

    def attend(q, k, v, lengths):
        return fp4_decode_attention(q, k, v, lengths, implementation="pallas", interpret=False)

    _, args = CASES["fp4_decode_attention"]
    with jax.set_mesh(mesh):
        sharded = _rows(mesh, args)
        text = jax.jit(attend).trace(*sharded).lower(lowering_platforms=("cuda",)).as_text()
    assert plgpu.CUSTOM_CALL_TARGET_NAME in text
    assert "sdy.manual_computation" in text, "the Triton call is left to the partitioner"
    manual = text.index("sdy.manual_computation")
    assert manual < text.index(plgpu.CUSTOM_CALL_TARGET_NAME)
    assert not re.search(r"stablehlo\.(all_gather|all_reduce|collective_permute|all_to_all)", text)
    assert "mhlo.num_partitions = 2" in text


def _triton_calls_outside_shard_maps(text: str) -> tuple[int, list[str]]:
    """(Triton calls in the lowered module `text`, the names of those outside every
    `sdy.manual_computation` region), by the regions' brace depth."""
    from jax.experimental.pallas import triton as plgpu

    calls, outside, depth, opens = 0, [], 0, []
    for line in text.splitlines():
        if "sdy.manual_computation" in line:
            opens.append(depth)
        if plgpu.CUSTOM_CALL_TARGET_NAME in line:
            calls += 1
            if not opens:
                name = re.search(r'name = \\?"(\w+)', line)
                outside.append(name.group(1) if name else line.strip()[:80])
        depth += line.count("{") - line.count("}")
        while opens and depth <= opens[-1]:
            opens.pop()
    return calls, outside


def test_fp4_rollout_on_a_data_mesh_runs_every_triton_call_per_device(mesh, h200_triton_lowering):
    """The FP4 rollout (`generate`, implementation "pallas") lowered for CUDA on the data-parallel
    mesh, parameters replicated and prompts split by rows as the RL workers place them: every
    Triton kernel (quantize, MoE matmul, decode attention) runs inside a shard_map; left to GSPMD
    each would get all-gathered operands."""
    from flax import nnx

    from tests import tiny
    from trace_jax.models import init_model
    from trace_jax.rl.methods import get_method
    from trace_jax.rl.sharding import mesh_context, shard_batch, shard_model
    from trace_jax.rollout import SamplingConfig, generate

    cfg = tiny.model_config(d_model=256, d_ff_expert=256, head_dim=128, grouped_matmul="pallas")
    setup = get_method("trace").setup("nvfp4", cfg.n_layers)
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, stop_tokens=(1,), pad_id=0)
    model = init_model(cfg, seed=0)
    shard_model(model, mesh)
    prompts = (jnp.ones((B, 8), jnp.int32), jnp.asarray([5, 8, 3, 6], jnp.int32))
    with mesh_context(mesh):
        prompts, lengths = shard_batch(prompts, mesh, B)
        graphdef, params = nnx.split(model)
        traced = generate.trace(
            graphdef, params, prompts, lengths, jax.random.key(0), sampling=sampling,
            qcfg=setup.rollout_qcfg, mode=setup.rollout_mode, capture=setup.capture,
            capture_mode=setup.capture_mode, implementation="pallas",
        )  # fmt: skip
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls, outside = _triton_calls_outside_shard_maps(text)
    assert calls and "mhlo.num_partitions = 2" in text
    assert not outside, f"Triton calls left to the partitioner: {outside}"
