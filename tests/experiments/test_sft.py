"""`experiments.sft`: the loss plot of a stage's metric rows; bad settings refused before
anything is created."""

from __future__ import annotations

import json

import pytest

from configs import tiny_cpu
from experiments import sft as sft_entry
from trace_jax.rl.config_dict import ConfigError


def test_plot_loss_from_the_metric_rows(tmp_path):
    rows = [{"step": s, "sft_nll": 2.0 / (s + 1)} for s in (0, 50, 99)]
    (tmp_path / "sft_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft_entry.plot_loss(str(tmp_path)) == str(tmp_path / "sft_loss.png")
    assert (tmp_path / "sft_loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_bad_setting_is_refused_before_the_workdir_exists(tmp_path):
    cd = tiny_cpu.get_config()
    cd.sft.batch_size = 0  # would train on empty batches to a loss of 0
    with pytest.raises(ConfigError, match=r"sft\.batch_size must be an int >= 1, got 0"):
        sft_entry.run(cd, str(tmp_path / "sft"))
    assert not any(tmp_path.iterdir())
