"""The uninterrupted run every recovery probe compares with, computed once per test process
(the probes that use it share one xdist group, so one worker computes it)."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from experiments import main as rl_entry
from tests.faults import runs


@dataclasses.dataclass(frozen=True)
class ReferenceRun:
    """workdir: the finished run (copy it before changing anything). rows: its metric rows
    without timings. state: its final parameters and optimizer state."""

    workdir: pathlib.Path
    rows: list[dict]
    state: list[np.ndarray]


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> ReferenceRun:
    workdir = tmp_path_factory.mktemp("reference") / "rl"
    history = rl_entry.run(runs.config_dict(), str(workdir))
    assert [h["step"] for h in history] == list(range(runs.STEPS))
    return ReferenceRun(workdir, runs.logged_rows(workdir), runs.final_state(workdir))
