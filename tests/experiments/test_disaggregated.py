"""`experiments.disaggregated`: the two child processes of `--role=both` and their flags; a
killed trainer stops the rollout process within seconds; a reused workdir is refused up front."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import disaggregated
from trace_jax.rl.disaggregated import WorkdirReusedError, heartbeat_path, read_heartbeat
from trace_jax.rl.exchange import Exchange

STAND_IN_TRAINER = """
import sys, time
from trace_jax.rl.disaggregated import Heartbeat
from trace_jax.rl.exchange import Exchange
beat = Heartbeat(Exchange.at(sys.argv[1]), "trainer", interval_s=0.2)
beat.step = 0
with beat:
    time.sleep(600)
"""


def test_both_roles_start_with_the_same_flags():
    argv = ["disaggregated.py", "--config=configs/tiny_cpu.py", "--role=both", "--workdir=/w"]
    trainer, rollout = disaggregated.role_commands([*argv, "--fresh"])
    common = [sys.executable, "-m", "experiments.disaggregated"]
    assert trainer == [*common, "--config=configs/tiny_cpu.py", "--workdir=/w", "--role=trainer"]
    assert rollout == [*common, "--config=configs/tiny_cpu.py", "--workdir=/w", "--role=rollout"]


def _wait_for_file(path: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.1)


def test_killed_trainer_stops_the_rollout_within_seconds(tmp_path):
    """The real rollout process (one subprocess: the cost of this test is its start-up) waits
    for policy version 0 from a trainer that beats and is then killed with SIGKILL."""
    workdir = str(tmp_path / "w")
    trainer = subprocess.Popen([sys.executable, "-c", STAND_IN_TRAINER, workdir])
    rollout = subprocess.Popen(
        [
            *disaggregated.role_commands(["x", f"--workdir={workdir}"])[1],
            "--config.model.n_layers=2",
            "--config.disaggregated.heartbeat_timeout_s=2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_file(heartbeat_path(workdir, "trainer"), trainer, 60)
        _wait_for_file(heartbeat_path(workdir, "rollout"), rollout, 60)
        trainer.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = rollout.communicate(timeout=30)
        took = time.monotonic() - killed_at
    finally:
        for proc in (trainer, rollout):
            proc.kill()
            proc.wait()
    assert rollout.returncode != 0 and took < 15, (took, err)
    assert f"error (rollout): the trainer (pid {trainer.pid} on " in err, err
    assert "is gone" in err and "last seen at step 0" in err and "policy version 0" in err, err
    beat = read_heartbeat(Exchange.at(workdir), "rollout")
    assert beat["exit"] == "failed" and "PartnerGoneError" in beat["error"]


def test_both_roles_refuse_a_reused_workdir_before_starting(tmp_path, monkeypatch):
    (tmp_path / "rl_metrics.jsonl").write_text("")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    with pytest.raises(WorkdirReusedError, match="earlier trainer run"):
        disaggregated.run_both(["x", f"--workdir={tmp_path}"], str(tmp_path))
