"""Kill -9 at every fault point of `trace_jax.faults`, then resume: one workdir of
`experiments.main` is killed during a checkpoint save, after a rollout and during a guidance
write, each rerun resuming from what the kill before left (an uncommitted checkpoint, a step
without its rows, guidance data without its manifest); a last rerun finishes the run, which logs
and ends exactly as the uninterrupted one.

The kills are subprocesses (SIGKILL ends the process that gets it), each dying at a fixed place
in the program (`TRACE_JAX_FAULT`), never after a delay."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from experiments import main as rl_entry
from tests.faults import runs
from trace_jax.faults import FAULT_ENV, maybe_die, parse_fault

# (fault, the steps logged once the process died there). A checkpoint save waits for the one
# before it, so after the first kill step 0's checkpoint is committed and every rerun resumes.
KILLS = (
    ("checkpoint_save:1", [0, 1]),  # step 1 logged, its save in flight
    ("rollout:2", [0, 1]),  # resumed at step 1 or 2; dies before step 2 writes anything
    ("guidance_write:2", [0, 1]),  # resumed again; step 2's guidance data but no manifest
)


def _killed_at(fault: str, workdir) -> subprocess.CompletedProcess:
    env = {**os.environ, FAULT_ENV: fault}
    return subprocess.run(
        runs.command_line(workdir), cwd=runs.ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


# The shared in-process run compiles the same steps as the RL loop tests' reference run.
@pytest.mark.xdist_group("uninterrupted_run")
def test_killed_at_every_fault_point_then_resumed_equals_the_uninterrupted_run(
    tmp_path, reference_run
):
    workdir = tmp_path / "rl"
    step_2 = workdir / "guidance" / "trace_nvfp4" / "step_0000000002" / "mb_00000"
    for fault, logged in KILLS:
        died = _killed_at(fault, workdir)
        assert died.returncode == -signal.SIGKILL, (fault, died.returncode, died.stderr[-3000:])
        assert [r["step"] for r in runs.logged_rows(workdir)] == logged, fault
        if fault.startswith("rollout"):
            assert not step_2.exists()
        if fault.startswith("guidance_write"):  # the data is written, the commit is not
            assert [p.name[:5] for p in step_2.iterdir()] == ["data_"]
    rerun = rl_entry.run(runs.config_dict(), str(workdir))  # as `experiments.main` would
    assert rerun[-1]["step"] == runs.STEPS - 1
    runs.assert_same_run(workdir, reference_run)


def test_the_fault_variable_is_parsed_and_refused_when_misspelt(monkeypatch):
    assert parse_fault("guidance_write:12") == ("guidance_write", 12)
    for spec in ("rollout", "rollout:", "rollout:-1", "roll_out:1", "rollout:x"):
        with pytest.raises(ValueError, match=f"{FAULT_ENV}={spec!r}: expected <point>:<step>"):
            parse_fault(spec)
    monkeypatch.setenv(FAULT_ENV, "rollout:3")
    maybe_die("rollout", 2)  # another step, or another point: this process lives on
    maybe_die("checkpoint_save", 3)
    monkeypatch.setenv(FAULT_ENV, "checkpoint_save")
    with pytest.raises(ValueError, match="checkpoint_save"):
        maybe_die("rollout", 0)
