"""The memory-fit entry point: its config, and the smoke run's rows and files."""

from __future__ import annotations

import json

import pytest

from configs import memory_fit as config_module
from experiments import memory_fit as experiment
from trace_jax.rl.memory_fit import GB


def test_config_names_its_entry_point_and_smoke_changes_only_values():
    assert "python -m experiments.memory_fit" in config_module.__doc__
    config, smoke = config_module.get_config(), config_module.get_config("smoke")
    assert smoke.smoke and not config.smoke
    assert sorted(smoke.to_dict()) == sorted(config.to_dict())
    assert {d * f * e for d, f, e in config.meshes} == {8, 64}
    with pytest.raises(ValueError, match="unknown config variant 'large'"):
        config_module.get_config("large")


def test_smoke_run_writes_the_fit_table(tmp_path):
    rows = experiment.run(config_module.get_config("smoke"), outdir=str(tmp_path), name="fit")
    # The 4-block tiny preset (V = D = F = 64, H = 4, Hkv = 2, Dh = 16, E = 8) in float32:
    # 453312 parameters whole; on 2 x 2 x 2 its matrices halve and its routed experts quarter.
    whole, split = 453312 * 4, 514816
    assert [round(r["params_GB"] * GB) for r in rows] == [whole, split]
    assert [r["fits_0.003GB"] for r in rows] == ["no", "yes"]  # 7.3 MB and 2.1 MB of state
    saved = json.loads((tmp_path / "fit.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert "| 8 | 2 | 2 | 2 | float32 |" in (tmp_path / "fit.md").read_text()
    bad = config_module.get_config("smoke")
    bad.preset = "huge"
    with pytest.raises(ValueError, match=r"config\.preset='huge'; expected one of"):
        experiment.run(bad, outdir=str(tmp_path), name="fit")
