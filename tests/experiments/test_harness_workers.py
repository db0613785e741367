"""Worker subprocesses: the command each runs, its GPU, and failures reported by item."""

from __future__ import annotations

import sys

import pytest

from experiments import harness


def test_worker_command_keeps_flags_but_gpus_and_old_worker_flag():
    argv = ["prog", "--config=c.py", "--gpus=0,1", "--worker_seed=5", "--bf16_policy=a"]
    cmd = harness.worker_command("experiments.ptq_table", "worker_seed", 2, argv)
    assert cmd == [
        sys.executable, "-m", "experiments.ptq_table", "--worker_seed=2", "--config=c.py",
        "--bf16_policy=a",
    ]  # fmt: skip


def test_run_workers_pins_gpus_round_robin_and_reports_failures(monkeypatch):
    launched = []

    class Proc:
        def __init__(self, cmd, env):
            launched.append((cmd[3], env["CUDA_VISIBLE_DEVICES"]))
            assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # workers share GPUs
            self.code = 1 if cmd[3] == "--worker_seed=1" else 0

        def wait(self):
            return self.code

    monkeypatch.setattr(harness.subprocess, "Popen", Proc)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    failed = harness.run_workers("m", "worker_seed", range(3), ["0", "1"], ["prog"])
    assert launched == [
        ("--worker_seed=0", "0"),
        ("--worker_seed=1", "1"),
        ("--worker_seed=2", "0"),
    ]
    assert failed == [1]
    with pytest.raises(ValueError, match="GPU"):
        harness.run_workers("m", "worker_seed", range(3), [], ["prog"])
