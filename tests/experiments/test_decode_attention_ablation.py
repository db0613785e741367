"""The decode-attention ablation runs its cut-down kernels in interpret mode (numbers are not
checked: CPU timings of interpreted kernels mean nothing); its `full` stage is the production
kernel, checked bit for bit inside `bench`."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import pytest

from configs import decode_attention_ablation as config_module
from experiments import decode_attention_ablation as abl
from experiments import harness
from kernels_pallas.fp4_decode_attention import kernel as K
from trace_jax import fp4
from trace_jax.fp4 import PackedTensorCache

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def test_every_stage_runs_and_a_failing_stage_is_recorded(monkeypatch):
    """A body that cannot lower, or a full variant computing other attention than the api
    kernel, is an error row; every other row is still timed."""

    def broken(*args, **kwargs):  # stands in for a body Triton cannot lower
        raise RuntimeError("simulated lowering failure")

    real = abl.slot_major

    def corrupted(cache):  # one code bit flipped everywhere: other attention
        moved = real(cache)
        return dataclasses.replace(moved, codes=moved.codes ^ 0x11)

    monkeypatch.setitem(abl.BODIES, "scores", broken)
    monkeypatch.setattr(abl, "slot_major", corrupted)
    config = config_module.get_config("smoke")
    config.contexts = (200,)  # not a multiple of the block
    rows, _ = abl.bench(config)
    by_variant = {r["variant"]: r for r in rows}
    inner = {f"fp4 {s}, slot-major cache" for s in abl.SLOT_MAJOR_STAGES}
    inner |= {"fp4 full, p.v transposed"}
    assert set(by_variant) == {*(f"fp4 {s}" for s in abl.STAGES), *inner, "bf16 twin (full)",
                               "read ceiling, FP4 bytes"}  # fmt: skip
    corrupt = "fp4 full, slot-major cache"
    assert "differs from the api kernel" in by_variant[corrupt]["error"]
    inner.remove(corrupt)
    assert all(by_variant[v]["ms"] > 0 and "added_ms" not in by_variant[v] for v in inner)
    assert "simulated lowering failure" in by_variant["fp4 scores"]["error"]
    for stage in ("load", "decode", "softmax", "full"):
        assert by_variant[f"fp4 {stage}"]["ms"] > 0
    # Each stage's cost is over the stage before it, unless that one failed.
    assert "added_ms" in by_variant["fp4 decode"] and "added_ms" in by_variant["fp4 full"]
    assert "added_ms" not in by_variant["fp4 softmax"]


@pytest.mark.parametrize(
    "stage, layout",
    [*((s, "head-major") for s in abl.STAGES), *((s, "slot-major") for s in abl.SLOT_MAJOR_STAGES)],
)
def test_every_stage_lowers_through_triton_without_a_gpu(h200_triton_lowering, stage, layout):
    """Each cut-down body lowers to Triton IR for an H200 at the paper-like shape (a body Triton
    cannot lower would cost a GPU run to find out), over either cache layout."""
    b, s, hkv, g, dh = 2, 1000, 4, 8, 128
    q = jax.ShapeDtypeStruct((b, hkv * g, dh), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    cache = jax.eval_shape(lambda: PackedTensorCache.empty((b, s, hkv, dh), fp4.NVFP4))
    if layout == "slot-major":
        cache = jax.eval_shape(abl.slot_major, cache)
    config = K.BlockConfig(block_s=64, chunk=128, block_g=16)
    op = functools.partial(
        abl.run_stage, stage=stage, config=config, interpret=False,
        slot_major=layout == "slot-major",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        lowered = jax.jit(op).trace(q, cache, cache, lengths).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("fmt", [fp4.NVFP4, fp4.MXFP4], ids=lambda f: f.name)
def test_slot_major_copy_gives_the_same_attention(fmt):
    """Over a slot-major copy of the (head-major) cache the production body computes the same
    attention, bit for bit (ragged lengths, several splits, two kv heads); the copy holds the
    same bytes."""
    b, s, hkv, g, dh = 3, 300, 2, 4, 64
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (b, hkv * g, dh), jnp.bfloat16)
    k, v = (2.0 * jax.random.normal(kk, (b, s, hkv, dh)) for kk in keys[1:])
    kc, vc = harness.packed_kv_cache(k, fmt), harness.packed_kv_cache(v, fmt)
    lengths = jnp.array([300, 129, 1], jnp.int32)
    config = K.BlockConfig(block_s=64, chunk=128, block_g=8)  # 3 splits
    run = functools.partial(abl.run_stage, stage="full", config=config, interpret=True)
    want = run(q, kc, vc, lengths)
    ks = abl.slot_major(kc)
    assert ks.codes.shape == (b, s, hkv, dh // 2)
    assert (ks.codes[1, 7, 0] == kc.codes[1, 0, 7]).all()
    got = run(q, ks, abl.slot_major(vc), lengths, slot_major=True)
    assert jnp.isfinite(want.astype(jnp.float32)).all()
    assert (got.astype(jnp.float32) == want.astype(jnp.float32)).all()
