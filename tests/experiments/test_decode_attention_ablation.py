"""The decode-attention ablation runs its cut-down kernels in interpret mode (numbers are not
checked: CPU timings of interpreted kernels mean nothing); its `full` stage is the production
kernel, checked bit for bit inside `bench`."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest

from experiments import decode_attention_ablation as abl
from kernels_pallas.fp4_decode_attention import kernel as K
from trace_jax import fp4
from trace_jax.models.packed_kv_cache import PackedTensorCache


def test_every_stage_runs_and_a_failing_stage_is_recorded(monkeypatch):
    def broken(*args, **kwargs):  # stands in for a body Triton cannot lower
        raise RuntimeError("simulated lowering failure")

    monkeypatch.setitem(abl.BODIES, "scores", broken)
    rows, _ = abl.bench(quick=True, contexts=[200])  # 200: not a multiple of the block
    by_variant = {r["variant"]: r for r in rows}
    inner = {f"fp4 {s}, kv heads inner" for s in abl.HEADS_INNER_STAGES}
    assert set(by_variant) == {*(f"fp4 {s}" for s in abl.STAGES), *inner, "bf16 twin (full)",
                               "read ceiling, FP4 bytes"}  # fmt: skip
    assert all(by_variant[v]["ms"] > 0 and "added_ms" not in by_variant[v] for v in inner)
    assert "simulated lowering failure" in by_variant["fp4 scores"]["error"]
    for stage in ("load", "decode", "softmax", "full"):
        assert by_variant[f"fp4 {stage}"]["ms"] > 0
    # Each stage's cost is over the stage before it, unless that one failed.
    assert "added_ms" in by_variant["fp4 decode"] and "added_ms" in by_variant["fp4 full"]
    assert "added_ms" not in by_variant["fp4 softmax"]


@pytest.mark.parametrize("stage", abl.STAGES)
def test_every_stage_lowers_through_triton_without_a_gpu(h200_triton_lowering, stage):
    """Each cut-down body lowers to Triton IR for an H200 at the paper-like shape (a body Triton
    cannot lower would cost a GPU run to find out)."""
    b, s, hkv, g, dh = 2, 1000, 4, 8, 128
    q = jax.ShapeDtypeStruct((b, hkv * g, dh), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    cache = jax.eval_shape(lambda: PackedTensorCache.empty((b, s, hkv, dh), fp4.NVFP4))
    config = K.BlockConfig(block_s=64, chunk=128, block_g=16)
    op = functools.partial(abl.run_stage, stage=stage, config=config, interpret=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        lowered = jax.jit(op).trace(q, cache, cache, lengths).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
