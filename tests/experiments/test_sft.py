"""`experiments.sft`: the loss plot of a stage's metric rows."""

from __future__ import annotations

import json

from experiments import sft as sft_entry


def test_plot_loss_from_the_metric_rows(tmp_path):
    rows = [{"step": s, "sft_nll": 2.0 / (s + 1)} for s in (0, 50, 99)]
    (tmp_path / "sft_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft_entry.plot_loss(str(tmp_path)) == str(tmp_path / "sft_loss.png")
    assert (tmp_path / "sft_loss.png").read_bytes()[:4] == b"\x89PNG"
