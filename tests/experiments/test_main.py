"""`experiments.main`: the RL curves plot of a run's metric rows; bad settings refused before
anything is created."""

from __future__ import annotations

import json

import pytest

from configs import tiny_cpu
from experiments import main as rl_entry
from trace_jax.rl.config_dict import ConfigError


def test_plot_curves_from_the_metric_rows(tmp_path):
    assert rl_entry.plot_curves(str(tmp_path)) is None  # no rows yet: no plot
    rows = [
        {"step": s, "reward": 0.1 * s, "train_rollout_gap_mean": 0.01, "response_length": 5.0}
        for s in range(3)
    ]
    (tmp_path / "rl_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = rl_entry.plot_curves(str(tmp_path))
    assert path == str(tmp_path / "rl_curves.png")
    assert (tmp_path / "rl_curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("checkpoint_every", 0, r"rl\.checkpoint_every must be an int >= 1, got 0"),
        ("eval_every", -1, r"rl\.eval_every must be an int >= 0, got -1"),
        ("prompts_per_step", 0, r"rl\.prompts_per_step must be an int >= 1, got 0"),
        ("steps", 0, r"rl\.steps must be an int >= 1, got 0"),
    ],
)
def test_a_bad_setting_is_refused_before_the_workdir_exists(tmp_path, setting, value, message):
    cd = tiny_cpu.get_config()
    cd.rl[setting] = value
    with pytest.raises(ConfigError, match=message):
        rl_entry.run(cd, str(tmp_path / "rl"), fresh=True)
    assert not any(tmp_path.iterdir())
