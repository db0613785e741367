"""The GRPO step-time report: phase medians over steady steps, shares and ratios."""

from __future__ import annotations

import json
import os

import matplotlib.axes
import numpy as np
import pytest

from experiments import main as rl_main
from experiments import rl_step_time
from tests import tiny


def _fake_run(times: dict[str, list[tuple[float, float, float]]]):
    """Stands in for `rl_main.run`: logs the given (rollout, guidance I/O, train) per step."""

    def run(cfg, workdir, **kw):
        assert cfg.rl.eval_every == 0 and cfg.rl.mismatch_every == 0 and not cfg.rl.init_from
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "rl_metrics.jsonl"), "w") as f:
            for step, t in enumerate(times[cfg.rl.method][: cfg.rl.steps]):
                row = dict(zip(rl_step_time.PHASES, t, strict=True))
                row["time_guidance_write_s"] = 0.25 * t[1]
                row["time_guidance_read_s"] = 0.75 * t[1]
                f.write(json.dumps({"step": step, "reward": 0.1 * step, **row}) + "\n")

    return run


def test_report_medians_of_steady_steps_and_ratio(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    times = {
        m: [(60.0, 0.0, 30.0)] + [tuple(rng.uniform(0.1, 1.0, 3)) for _ in range(6)]
        for m in ("trace", "fp4_qat")
    }
    monkeypatch.setattr(rl_main, "run", _fake_run(times))
    rows = rl_step_time.run(
        tiny.experiment_config(),
        workdir=str(tmp_path / "w"),
        methods=["trace", "fp4_qat"],
        steps=6,
        skip=1,
        outdir=str(tmp_path / "out"),
        name="st",
    )
    for row in rows:
        steady = np.asarray(times[row["method"]][1:6])  # steps 1..5: compile step left out
        for j, phase in enumerate(rl_step_time.PHASES):
            assert row[phase] == pytest.approx(np.median(steady[:, j]))
        assert row["time_step_s"] == pytest.approx(np.median(steady.sum(1)))
        assert row["guidance_io_share"] == pytest.approx(
            row["time_guidance_io_s"] / row["time_step_s"]
        )
        assert row["steps_timed"] == 5
        assert row["time_guidance_read_s"] == pytest.approx(np.median(0.75 * steady[:, 1]))
    trace, qat = rows
    assert trace["step_vs_reference"] == pytest.approx(trace["time_step_s"] / qat["time_step_s"])
    assert qat["step_vs_reference"] == 1.0  # the last method is the reference
    assert "TRACE vs plain FP4" in (tmp_path / "out" / "st.md").read_text()
    assert "peak_memory_gib" not in trace  # not recorded (one process, no memory files)
    assert (tmp_path / "out" / "st.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_stacks_each_methods_phases(tmp_path, monkeypatch):
    rows = [
        {"method": "trace", "time_rollout_s": 0.3, "time_guidance_io_s": 0.12,
         "time_guidance_write_s": 0.08, "time_guidance_read_s": 0.04, "time_train_s": 0.33,
         "time_step_s": 0.75, "step_vs_reference": 1.39},
        {"method": "fp4_qat", "time_rollout_s": 0.31, "time_guidance_io_s": 0.0,
         "time_guidance_write_s": 0.0, "time_guidance_read_s": 0.0, "time_train_s": 0.25,
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
    keys = ["time_rollout_s", "time_guidance_write_s", "time_guidance_read_s", "time_train_s"]
    assert [b[1] for b in bars] == [[r[k] for r in rows] for k in keys]
    lefts = np.cumsum([[0.0, 0.0], *[b[1] for b in bars[:-1]]], axis=0)
    np.testing.assert_allclose([b[2] for b in bars], lefts)
    # Rows without the write / read split (logged since 2026-11-30): one guidance I/O segment.
    old = [{k: v for k, v in r.items() if k not in keys[1:3]} for r in rows]
    (tmp_path / "old.json").write_text(json.dumps({"rows": old}))
    bars.clear()
    rl_step_time.plot_from(str(tmp_path / "old.json"))
    assert [b[0] for b in bars] == ["rollout", "guidance I/O", "training"]
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"policy": "x"}]}))
    with pytest.raises(ValueError, match=r"not a result written by experiments\.rl_step_time"):
        rl_step_time.plot_from(str(tmp_path / "other.json"))


def test_peak_memory_recorded_per_method_process(tmp_path, monkeypatch):
    times = {m: [(1.0, 0.0, 1.0)] * 4 for m in ("a", "b")}
    monkeypatch.setattr(rl_main, "run", _fake_run(times))
    work = tmp_path / "w"
    peaks = {"a": 3 * 2**30, "b": 5 * 2**29}

    class Device:
        def __init__(self, m):
            self.m = m

        def memory_stats(self):
            return {"peak_bytes_in_use": peaks[self.m], "bytes_in_use": 1}

    for m in ("a", "b"):  # what each --gpus subprocess does
        monkeypatch.setattr(rl_step_time.jax, "local_devices", lambda m=m: [Device(m)])
        rl_step_time.run_method(tiny.experiment_config(), str(work), m, 4, record_memory=True)
    rows = rl_step_time.report(str(work), ["a", "b"], 1, "b")
    assert [r["peak_memory_gib"] for r in rows] == [3.0, 2.5]


def test_bad_arguments(tmp_path):
    cfg = tiny.experiment_config()
    kw = dict(workdir=str(tmp_path), methods=["trace", "fp4_qat"], outdir=str(tmp_path))
    with pytest.raises(ValueError, match="--reference"):
        rl_step_time.run(cfg, steps=5, reference="bf16", **kw)
    with pytest.raises(ValueError, match="no step after"):
        rl_step_time.run(cfg, steps=2, skip=2, **kw)
    with pytest.raises(ValueError, match="need 2 --gpus"):
        rl_step_time.run(cfg, steps=5, gpus=["0"], **kw)
    with pytest.raises(ValueError, match="no steps after"):
        rl_step_time.step_times([{"step": 0}], skip=1)
