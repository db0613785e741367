"""The rollout-collectives entry point: its config, and a smoke run's rows and files."""

from __future__ import annotations

import json

import jax
import pytest

from configs import rollout_collectives as config_module
from experiments import rollout_collectives as experiment


def test_config_names_its_entry_point_and_smoke_changes_only_values():
    assert "python -m experiments.rollout_collectives" in config_module.__doc__
    config, smoke = config_module.get_config(), config_module.get_config("smoke")
    assert smoke.smoke and not config.smoke
    assert sorted(smoke.to_dict()) == sorted(config.to_dict())
    with pytest.raises(ValueError, match="unknown config variant 'large'"):
        config_module.get_config("large")


def test_smoke_run_counts_the_moe_collectives_of_each_routing(tmp_path):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py)")
    config = config_module.get_config("smoke")
    config.variants = ("bf16",)
    rows = experiment.run(config, outdir=str(tmp_path), name="rc")
    by_routing = {r["moe_routing"]: r for r in rows}
    assert by_routing["per_device"]["decode_moe"] == by_routing["per_device"]["prefill_moe"] == 0
    assert by_routing["per_device"]["decode_step"] == 1  # the loop's every-row-finished test
    assert by_routing["gspmd"]["decode_moe_per_layer"] >= 1
    saved = json.loads((tmp_path / "rc.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert "| bf16 | per_device | 1 | 0 |" in (tmp_path / "rc.md").read_text()
    config.variants = ("int8",)
    with pytest.raises(ValueError, match="unknown variant 'int8'"):
        experiment.run(config, outdir=str(tmp_path), name="rc")
