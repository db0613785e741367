"""The step-time entry point: the report written and drawn, the redraw, GPU worker checks, and
the smoke config run for real."""

from __future__ import annotations

import json
import os

import matplotlib.axes
import numpy as np
import pytest

from configs import rl_step_time as rl_step_time_config
from experiments import rl_step_time
from tests import tiny
from tests.tables.support import fake_loop
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables import step_time
from trace_jax.tables.step_time import PHASES, StepTimeConfig


def test_report_written(tmp_path, monkeypatch):
    times = {m: [(9.0, 0.0, 9.0)] + [(0.3, 0.1, 0.2)] * 3 for m in ("trace", "fp4_qat")}
    monkeypatch.setattr(step_time, "RLLoop", fake_loop(times))
    config = ExperimentConfig.from_config_dict(tiny.experiment_config())
    timing = StepTimeConfig(steps=4, skip=1)
    rows = rl_step_time.run(
        config, timing, workdir=str(tmp_path / "w"), outdir=str(tmp_path), name="st"
    )
    assert [r["method"] for r in rows] == ["trace", "fp4_qat"]
    assert rows[0]["time_step_s"] == pytest.approx(0.6) and rows[1]["step_vs_reference"] == 1.0
    assert "TRACE vs plain FP4" in (tmp_path / "st.md").read_text()
    assert "| trace | xla |" in (tmp_path / "st.md").read_text()  # the rollout's kernels
    assert "peak_memory_gib" not in (tmp_path / "st.md").read_text()
    assert (tmp_path / "st.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="need 2 --gpus"):
        rl_step_time.run(config, timing, workdir=str(tmp_path), gpus=["0"])


def test_plot_stacks_each_methods_phases(tmp_path, monkeypatch):
    rows = [
        {"method": "trace", "time_rollout_s": 0.3, "time_guidance_io_s": 0.14,
         "time_guidance_write_s": 0.08, "time_guidance_read_s": 0.04,
         "time_guidance_delete_wait_s": 0.02, "time_train_s": 0.33,
         "time_step_s": 0.77, "step_vs_reference": 1.38},
        {"method": "fp4_qat", "time_rollout_s": 0.31, "time_guidance_io_s": 0.0,
         "time_guidance_write_s": 0.0, "time_guidance_read_s": 0.0,
         "time_guidance_delete_wait_s": 0.0, "time_train_s": 0.25,
         "time_step_s": 0.56, "step_vs_reference": 1.0},
    ]  # fmt: skip
    (tmp_path / "st.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    bars = []
    barh = matplotlib.axes.Axes.barh

    def record(self, y, width, left=None, **kw):
        bars.append((kw["label"], list(width), list(left)))
        return barh(self, y, width, left=left, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", record)
    png = rl_step_time.plot_from(str(tmp_path / "st.json"))
    assert png == str(tmp_path / "st.png") and os.path.getsize(png) > 0
    io = ["time_guidance_write_s", "time_guidance_read_s", "time_guidance_delete_wait_s"]
    keys = ["time_rollout_s", *io, "time_train_s"]
    assert [b[1] for b in bars] == [[r[k] for r in rows] for k in keys]
    lefts = np.cumsum([[0.0, 0.0], *[b[1] for b in bars[:-1]]], axis=0)
    np.testing.assert_allclose([b[2] for b in bars], lefts)
    # Rows of older runs, without the deletion wait: write and read only.
    older = [{k: v for k, v in r.items() if k != io[2]} for r in rows]
    (tmp_path / "older.json").write_text(json.dumps({"rows": older}))
    bars.clear()
    rl_step_time.plot_from(str(tmp_path / "older.json"))
    labels = [rl_step_time.IO_LABELS[k] for k in io[:2]]
    assert [b[0] for b in bars] == ["rollout", *labels, "training"]
    # Rows without the write / read split: one guidance I/O segment.
    merged = [{k: v for k, v in r.items() if k not in io} for r in rows]
    (tmp_path / "merged.json").write_text(json.dumps({"rows": merged}))
    bars.clear()
    rl_step_time.plot_from(str(tmp_path / "merged.json"))
    assert [b[0] for b in bars] == ["rollout", "guidance I/O", "training"]
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"policy": "x"}]}))
    with pytest.raises(ValueError, match=r"not a result written by experiments\.rl_step_time"):
        rl_step_time.plot_from(str(tmp_path / "other.json"))


# Its RL steps are the quickstart smoke run's (`configs/rl_step_time.py`): on that run's xdist
# worker they are compiled already.
@pytest.mark.xdist_group("quickstart_smoke_run")
def test_smoke_config_times_both_methods_for_real(tmp_path):
    cd = rl_step_time_config.get_config("smoke")
    config = ExperimentConfig.from_config_dict(cd)
    timing = from_section(StepTimeConfig, cd.step_time)
    rows = rl_step_time.run(
        config, timing, workdir=str(tmp_path / "w"), outdir=str(tmp_path), name="st"
    )
    assert [r["method"] for r in rows] == ["trace", "fp4_qat"]
    for r in rows:
        assert r["rollout_implementation"] == "xla"  # "auto" on the CPU
        assert r["steps_timed"] == timing.steps - timing.skip == 1
        assert all(r[k] > 0 for k in ("time_rollout_s", "time_train_s"))
        assert r["time_step_s"] == pytest.approx(sum(r[k] for k in PHASES))
    trace, qat = rows
    # TRACE's guidance goes through the store; the plain FP4 rollout has none to pass.
    assert trace["time_guidance_read_s"] > 0 and qat["time_guidance_read_s"] == 0
    assert qat["step_vs_reference"] == 1.0
    written = json.loads((tmp_path / "st.json").read_text())["rows"]
    assert [w["rollout_implementation"] for w in written] == ["xla", "xla"]
    assert (tmp_path / "st.png").read_bytes()[:4] == b"\x89PNG"
