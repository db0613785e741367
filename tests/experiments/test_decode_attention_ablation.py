"""The decode-attention ablation runs its cut-down kernels in interpret mode (numbers are not
checked: CPU timings of interpreted kernels mean nothing); its `full` stage is the production
kernel, checked bit for bit inside `bench`."""

from __future__ import annotations

from experiments import decode_attention_ablation as abl


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
    for stage in ("load", "decode", "full"):
        assert by_variant[f"fp4 {stage}"]["ms"] > 0
    assert "added_ms" in by_variant["fp4 decode"] and "added_ms" not in by_variant["fp4 full"]
