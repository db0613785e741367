"""The load-memory experiment: its random checkpoint, and the smoke run's rows and files."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

from configs import hf_load_memory as config_module
from experiments import hf_load_memory as experiment
from tests import tiny
from trace_jax.models.hf_checkpoint import hf_tensor_shapes, read_hf_config
from trace_jax.models.hf_files import SafetensorsCheckpoint


def test_config_names_its_entry_point_and_smoke_changes_only_values():
    assert "python -m experiments.hf_load_memory" in config_module.__doc__
    config, smoke = config_module.get_config(), config_module.get_config("smoke")
    assert smoke.smoke and not config.smoke
    assert sorted(smoke.to_dict()) == sorted(config.to_dict())
    with pytest.raises(ValueError, match="unknown config variant 'large'"):
        config_module.get_config("large")


def test_random_checkpoint_holds_every_tensor_in_bf16(tmp_path):
    cfg = tiny.model_config()
    total = experiment.write_random_checkpoint(str(tmp_path), cfg, n_shards=3, seed=0)
    shapes = hf_tensor_shapes(cfg)
    assert total == sum(2 * math.prod(s) for s in shapes.values())
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert {k: checkpoint.shape(k) for k in checkpoint.keys()} == shapes
    assert {checkpoint.dtype(k) for k in shapes} == {"BF16"}
    assert len({path.name for path in tmp_path.glob("model-*.safetensors")}) == 3
    assert read_hf_config(tmp_path) == cfg
    embed = checkpoint.read("model.embed_tokens.weight", ())
    assert embed.dtype == ml_dtypes.bfloat16 and 0.015 < np.std(embed.astype(np.float32)) < 0.025


def test_smoke_run_measures_each_load(tmp_path):
    config = config_module.get_config("smoke")
    config.workdir = str(tmp_path / "checkpoint")
    rows = experiment.run(config, outdir=str(tmp_path), name="mem")
    assert [r["load"] for r in rows] == ["full", "lazy", "sharded"]
    shapes = hf_tensor_shapes(tiny.model_config())
    tensor_bytes = sum(2 * math.prod(s) for s in shapes.values())
    experts = sum(2 * math.prod(s) for k, s in shapes.items() if ".mlp.experts." in k)
    data, expert = config.mesh
    # Routed experts split over the expert axis (held once per data replica), the rest on every
    # one of the data x expert devices.
    sharded = experts * data + (tensor_bytes - experts) * data * expert
    assert [round(r["device_GB"] * 1e9) for r in rows] == [tensor_bytes, tensor_bytes, sharded]
    for r in rows:
        assert r["checkpoint_GB"] * 1e9 == pytest.approx(tensor_bytes)
        assert r["peak_rss_GB"] >= r["before_GB"] > 0 and r["seconds"] > 0
        assert r["beyond_device_GB"] == pytest.approx(
            r["peak_rss_GB"] - r["before_GB"] - r["device_GB"]
        )
    saved = json.loads((tmp_path / "mem.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert "| sharded | 8 |" in (tmp_path / "mem.md").read_text()
    with pytest.raises(ValueError, match="loads of"):
        config.loads = ("mmap",)
        experiment.run(config, outdir=str(tmp_path), name="mem")
