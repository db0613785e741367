"""The guidance-store benchmark: real shapes of the method's sites, both durability settings."""

from __future__ import annotations

import json

import pytest

from configs import bench_guidance_store as config_module
from experiments import bench_guidance_store as bench
from tests import tiny


def test_guidance_has_the_sites_and_shapes_of_the_method():
    cfg = tiny.model_config()
    g = bench.random_guidance(cfg, "trace", "nvfp4", rows=3, tokens=5)
    deeper = range(cfg.n_layers // 2, cfg.n_layers)  # TRACE guides the deeper half
    assert set(g) == {
        f"{layer}/{s}" for layer in deeper for s in ("expert_in", "expert_mid", "k", "v")
    }
    last = cfg.n_layers - 1
    assert g[f"{last}/expert_in"].shape == (3, 5, cfg.d_model)
    assert g[f"{last}/expert_mid"].shape == (3, 5, cfg.top_k, cfg.d_ff_expert)
    assert g[f"{last}/k"].shape == (3, 5, cfg.n_kv_heads, cfg.head_dim)
    full = bench.random_guidance(cfg, "trace_full", "nvfp4", rows=3, tokens=5)
    assert len(full) == 4 * cfg.n_layers and full["0/v"].payload.shape[-1] == cfg.head_dim // 2


def tiny_config(**overrides):
    config = config_module.get_config()
    config.model.preset, config.rows, config.tokens, config.steps = "tiny", 4, 6, 1
    config.update(overrides)
    return config


def test_quick_run_writes_rows(tmp_path):
    rows = bench.run(tiny_config(), outdir=str(tmp_path), name="gs")
    assert [r["durable"] for r in rows] == [True, False]
    for r in rows:
        assert r["round_trip_s"] == pytest.approx(r["write_s"] + r["read_s"])
        assert r["MB_per_step"] > 0 and r["write_MBps"] > 0
    assert json.loads((tmp_path / "gs.json").read_text())["rows"] == json.loads(json.dumps(rows))
    with pytest.raises(ValueError, match="captures no guidance"):
        bench.run(tiny_config(method="fp4_qat"), outdir=str(tmp_path), name="x")
