"""`experiments.main`: the RL curves plot of a run's metric rows."""

from __future__ import annotations

import json

from experiments import main as rl_entry


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
