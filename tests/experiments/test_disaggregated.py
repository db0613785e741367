"""`experiments.disaggregated --role=both`: the two child processes and their flags."""

from __future__ import annotations

import sys

from experiments import disaggregated


def test_both_roles_start_with_the_same_flags():
    argv = ["disaggregated.py", "--config=configs/tiny_cpu.py", "--role=both", "--workdir=/w"]
    trainer, rollout = disaggregated.role_commands(argv)
    common = [sys.executable, "-m", "experiments.disaggregated"]
    assert trainer == [*common, "--config=configs/tiny_cpu.py", "--workdir=/w", "--role=trainer"]
    assert rollout == [*common, "--config=configs/tiny_cpu.py", "--workdir=/w", "--role=rollout"]
