"""The GRPO step-time report: phase medians over steady steps, shares, ratios, the rollout's
kernels, peak memory."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

from kernels_pallas import common
from tests import tiny
from tests.rl.rollouts import loop_config_dict
from tests.tables.support import fake_loop
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables import step_time
from trace_jax.tables.step_time import PHASES, StepTimeConfig


def test_report_medians_of_steady_steps_and_ratio(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    times = {
        m: [(60.0, 0.0, 30.0)] + [tuple(rng.uniform(0.1, 1.0, 3)) for _ in range(6)]
        for m in ("trace", "fp4_qat")
    }
    monkeypatch.setattr(step_time, "RLLoop", fake_loop(times))
    config = ExperimentConfig.from_config_dict(tiny.experiment_config())
    for m in ("trace", "fp4_qat"):  # one more step each, profiled: not in the medians
        step_time.run_method(config, str(tmp_path), m, 6, profile_steps=1)
        assert (tmp_path / m / step_time.PROFILE_DIR).is_dir()
    rows = step_time.report(str(tmp_path), ["trace", "fp4_qat"], 1, "fp4_qat", steps=6)
    for row in rows:
        steady = np.asarray(times[row["method"]][1:6])  # the compile step left out
        for j, phase in enumerate(PHASES):
            assert row[phase] == pytest.approx(np.median(steady[:, j]))
        assert row["time_step_s"] == pytest.approx(np.median(steady.sum(1)))
        assert row["guidance_io_share"] == pytest.approx(
            row["time_guidance_io_s"] / row["time_step_s"]
        )
        assert row["steps_timed"] == 5 and row["reward"] == pytest.approx(0.3)
        assert row["time_guidance_read_s"] == pytest.approx(np.median(0.75 * steady[:, 1]))
        assert "peak_memory_gib" not in row  # not recorded (no memory files)
        assert row["rollout_implementation"] == "xla"  # "auto" on the CPU
    trace, qat = rows
    assert trace["step_vs_reference"] == pytest.approx(trace["time_step_s"] / qat["time_step_s"])
    assert qat["step_vs_reference"] == 1.0


def test_profiled_steps_are_the_timed_runs_last_compiled_ones(tmp_path, monkeypatch):
    """A real run (the loop tests' 3 steps of the 1-block tiny model, so their compiled steps):
    2 timed steps and 1 profiled. Nothing is compiled while the profiler records: the profiled
    step is the timed run's own last step (a second run of another length would compile
    another update: its learning-rate schedule differs)."""
    lowered, profiling, real_trace = [], [], jax.profiler.trace

    @contextlib.contextmanager
    def trace(log_dir, **kw):
        with real_trace(log_dir, **kw):
            profiling.append(log_dir)
            try:
                yield
            finally:
                profiling.clear()

    def on_event(event, seconds, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and profiling:
            lowered.append(kw.get("fun_name"))

    monkeypatch.setattr(jax.profiler, "trace", trace)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        config = ExperimentConfig.from_config_dict(loop_config_dict())
        step_time.run_method(config, str(tmp_path), "trace", 2, profile_steps=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert lowered == []
    assert any((tmp_path / "trace" / step_time.PROFILE_DIR).rglob("*.xplane.pb"))
    (row,) = step_time.report(str(tmp_path), ["trace"], 1, "trace", steps=2)
    assert row["steps_timed"] == 1  # step 1; step 0 compiles, step 2 is profiled


def test_peak_memory_and_kernels_recorded_per_method_process(tmp_path, monkeypatch):
    """What each --gpus subprocess records: its device's peak memory, and its rollout's kernels
    as it resolves "auto" there (the Pallas kernels on a GPU)."""
    times = {m: [(1.0, 0.0, 1.0)] * 4 for m in ("bf16", "trace")}
    monkeypatch.setattr(step_time, "RLLoop", fake_loop(times))
    monkeypatch.setattr(common, "kernel_platform", lambda: "gpu")
    peaks = {"bf16": 3 * 2**30, "trace": 5 * 2**29}

    class Device:
        def __init__(self, m):
            self.m = m

        def memory_stats(self):
            return {"peak_bytes_in_use": peaks[self.m], "bytes_in_use": 1}

    config = ExperimentConfig.from_config_dict(tiny.experiment_config())
    for m in ("bf16", "trace"):  # what each --gpus subprocess does
        monkeypatch.setattr(step_time.jax, "local_devices", lambda m=m: [Device(m)])
        step_time.run_method(config, str(tmp_path), m, 4, record_memory=True)
    rows = step_time.report(str(tmp_path), ["bf16", "trace"], 1, "trace")
    assert [r["peak_memory_gib"] for r in rows] == [3.0, 2.5]
    assert [r["rollout_implementation"] for r in rows] == ["pallas", "pallas"]


def test_step_time_config_checks_its_fields():
    assert StepTimeConfig().reference_method == "fp4_qat"  # the last method
    assert StepTimeConfig(methods=("a", "b"), reference="a").reference_method == "a"
    with pytest.raises(ValueError, match="reference 'bf16'"):
        StepTimeConfig(reference="bf16")
    with pytest.raises(ValueError, match="no step after"):
        StepTimeConfig(steps=2, skip=2)
    with pytest.raises(ValueError, match="profile_steps must be >= 0"):
        StepTimeConfig(profile_steps=-1)
    with pytest.raises(ValueError, match="no steps after"):
        step_time.step_times([{"step": 0}], skip=1)
