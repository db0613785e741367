"""`experiments.multi_gpu` with its jobs stood in for (their logs written by hand): each section's
runs on the right devices, the rows it reports, and a section measured again replacing its rows
alone. The real jobs run in `configs/multi_gpu.py:smoke` (a CPU dry run of a few minutes)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from configs import multi_gpu as multi_gpu_config
from experiments import multi_gpu
from trace_jax.rl.metrics_log import read_rows
from trace_jax.tables import scale_out

GROUP = 8


def _workdir(cmd) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))


def _fake_jobs(monkeypatch, seconds_per_sample: float, jobs: list, meshes: list | None = None):
    """`run_job` writing each job's logs: a step of `rows` samples takes `seconds_per_sample`
    x rows / devices (perfect scaling) plus 0.1 s per extra process; step 1's loss differs by
    2e-7 (relative) between one process and several. `jobs` gets each job's (devices, is the
    trainer) per process, `meshes` its `--config.mesh.*` flags."""
    meshes = [] if meshes is None else meshes

    def run_job(procs, *, cpu, timeout_s):
        jobs.append([(p.devices, "--role=trainer" in p.cmd) for p in procs])
        meshes.append({a for a in procs[0].cmd if a.startswith("--config.mesh.")})
        devices = sum(len(p.devices) for p in procs)
        trainer = [p for p in procs if "--role=trainer" in p.cmd]
        workdir = _workdir((trainer or procs)[0].cmd)
        flags = dict(a[len("--config."):].split("=", 1) for a in procs[0].cmd
                     if a.startswith("--config."))  # fmt: skip
        steps, prompts = int(flags["rl.steps"]), int(flags["rl.prompts_per_step"])
        step_s = seconds_per_sample * prompts * GROUP / devices + 0.1 * (len(procs) - 1)
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "rl_config.json"), "w") as f:
            json.dump({"rl.group_size": GROUP}, f)
        with open(os.path.join(workdir, "rl_metrics.jsonl"), "w") as f:
            for s in range(steps):
                row = {"step": s, "reward": 0.5, "loss": 1.0 + 2e-7 * (len(procs) > 1 and s == 1)}
                if trainer:
                    lag = int(flags["disaggregated.lag"])
                    row |= {"time_step_s": step_s, "time_wait_rollout_s": 0.01,
                            "max_staleness_used": lag}  # fmt: skip
                else:
                    row |= {"time_rollout_s": step_s / 2, "time_guidance_io_s": 0.0,
                            "time_train_s": step_s / 2}  # fmt: skip
                f.write(json.dumps(row) + "\n")
        return 1.0

    monkeypatch.setattr(scale_out, "run_job", run_job)


def test_every_section_on_four_gpus_then_one_section_again(tmp_path, monkeypatch):
    monkeypatch.setattr(multi_gpu, "visible_gpus", lambda: [0, 1, 2, 3])
    jobs, meshes = [], []
    _fake_jobs(monkeypatch, 0.01, jobs, meshes)
    cfg = multi_gpu_config.get_config()
    cfg.steps, cfg.disaggregated_steps = 5, 6
    rows = multi_gpu.run(cfg, str(tmp_path / "w"), str(tmp_path), "mg")
    assert [(r["section"], r["setting"]) for r in rows] == [
        ("parity", "1 GPU"), ("parity", "4 GPUs, 1 process"), ("parity", "4 GPUs, 4 processes"),
        ("expert_parallel", "4 GPUs, 1 process, expert 4"),
        ("expert_parallel", "4 GPUs, 4 processes, expert 4"),
        ("disaggregated", "lag 0"), ("disaggregated", "lag 1"),
        ("weak_scaling", "1 GPU"), ("weak_scaling", "2 GPUs"), ("weak_scaling", "4 GPUs"),
    ]  # fmt: skip
    # parity: one process sees the 4 GPUs, or 4 processes one each; the pair: GPUs 0 and 1.
    four = [((k,), False) for k in range(4)]
    assert jobs[:5] == [
        [((0,), False)],
        [((0, 1, 2, 3), False)],
        four,
        [((0, 1, 2, 3), False)],
        four,
    ]
    assert jobs[5] == [((0,), False), ((1,), True)]
    # parity runs data-parallel, the expert section splits the experts over all four.
    data_4 = {"--config.mesh.data=4"}
    expert_4 = {"--config.mesh.data=1", "--config.mesh.expert=4"}
    assert meshes[:5] == [{"--config.mesh.data=1"}, data_4, data_4, expert_4, expert_4]
    for parity in (rows[2], rows[4]):
        assert parity["exact_equal"] and parity["worst"] == "loss" and parity["parity_step"] == 1
        np.testing.assert_allclose(parity["max_rel_diff"], 2e-7 / (1 + 2e-7))
    # 32 prompts x 8 samples: 2.56 s on one GPU, 0.64 + 0.3 s on four processes.
    np.testing.assert_allclose([r["time_step_s"] for r in rows[:5]], [2.56, 0.64, 0.94, 0.64, 0.94])
    np.testing.assert_allclose(rows[0]["samples_per_s"], 256 / 2.56)
    assert [r["staleness_max"] for r in rows[5:7]] == [0, 1]
    # weak scaling: 8 prompts per GPU; 0.64 s + 0.1 s per extra process.
    weak = rows[7:]
    np.testing.assert_allclose([r["time_step_s"] for r in weak], [0.64, 0.74, 0.94])
    np.testing.assert_allclose([r["efficiency"] for r in weak], [1, 0.64 / 0.74, 0.64 / 0.94])
    written = json.loads((tmp_path / "mg.json").read_text())["rows"]
    assert [r["setting"] for r in written] == [r["setting"] for r in rows]
    # Each row says when its section was measured (the rows kept below keep theirs).
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", r["measured"]) for r in written)
    assert "| weak_scaling | 4 GPUs | 4 | 4 |" in (tmp_path / "mg.md").read_text()

    # Weak scaling again, twice as slow: its rows replaced, the others kept.
    _fake_jobs(monkeypatch, 0.02, jobs)
    cfg.measure = ("weak_scaling",)
    again = multi_gpu.run(cfg, str(tmp_path / "w2"), str(tmp_path), "mg")
    assert again[:7] == json.loads(json.dumps(rows[:7]))
    np.testing.assert_allclose([r["time_step_s"] for r in again[7:]], [1.28, 1.38, 1.58])
    assert read_rows(str(tmp_path / "w2" / "weak_4" / "rl_metrics.jsonl"))[0]["step"] == 0


def test_a_failing_section_keeps_the_sections_measured_before_it(tmp_path, monkeypatch):
    monkeypatch.setattr(multi_gpu, "visible_gpus", lambda: [0, 1])
    _fake_jobs(monkeypatch, 0.01, [])

    def failing(self):
        raise scale_out.JobFailedError("a process died")

    monkeypatch.setattr(multi_gpu.Measurement, "weak_scaling", failing)
    cfg = multi_gpu_config.get_config()
    cfg.steps, cfg.disaggregated_steps = 4, 4
    with pytest.raises(scale_out.JobFailedError):
        multi_gpu.run(cfg, str(tmp_path / "w"), str(tmp_path), "mg")
    written = json.loads((tmp_path / "mg.json").read_text())["rows"]
    assert [r["section"] for r in written] == (
        ["parity"] * 3 + ["expert_parallel"] * 2 + ["disaggregated"] * 2
    )


def test_bad_requests_are_refused_before_any_job(tmp_path, monkeypatch):
    jobs = []
    _fake_jobs(monkeypatch, 0.01, jobs)
    cfg = multi_gpu_config.get_config()
    monkeypatch.setattr(multi_gpu, "visible_gpus", lambda: [0, 1])
    cfg.gpus = 4
    with pytest.raises(ValueError, match=r"config\.gpus=4 but 2 GPUs are visible"):
        multi_gpu.run(cfg, str(tmp_path), str(tmp_path), "mg")
    monkeypatch.setattr(multi_gpu, "visible_gpus", lambda: [None])
    cfg.gpus = 0
    with pytest.raises(ValueError, match="no GPU visible"):
        multi_gpu.run(cfg, str(tmp_path), str(tmp_path), "mg")
    cfg.gpus, cfg.measure = 1, ("parity", "disaggregated")  # refused before parity runs
    with pytest.raises(ValueError, match="needs two GPUs"):
        multi_gpu.run(cfg, str(tmp_path), str(tmp_path), "mg")
    cfg.measure = ("expert_parallel",)
    with pytest.raises(ValueError, match="expert parallelism needs two GPUs"):
        multi_gpu.run(cfg, str(tmp_path), str(tmp_path), "mg")
    cfg.measure = ("strong_scaling",)
    with pytest.raises(ValueError, match="unknown sections"):
        multi_gpu.run(cfg, str(tmp_path), str(tmp_path), "mg")
    assert not jobs
