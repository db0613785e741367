"""The run the fault probes share: `experiments.main` on `configs/tiny_cpu.py` cut to 3 steps of
2 prompts x 2 samples on the 1-block tiny model, a checkpoint every step. The same shapes as
`tests/rl/test_loop.py`'s runs, so one compilation of their steps serves both.

`OVERRIDES` is the one list of settings: `config_dict()` applies them in this process,
`command_line()` passes them to a subprocess, so both run the same experiment."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from flax import nnx

from configs import tiny_cpu
from tests.rl.rollouts import LOOP_LAYERS
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.loop import RLLoop
from trace_jax.rl.metrics_log import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
OVERRIDES = {
    "model.n_layers": LOOP_LAYERS,
    "rl.steps": STEPS,
    "rl.prompts_per_step": 2,
    "rl.group_size": 2,
    "rl.max_new_tokens": 8,
    "rl.learning_rate": 0.01,
    "rl.mismatch_every": 0,
    "rl.eval_every": 0,
    "rl.checkpoint_every": 1,
}


def config_dict():
    """`configs/tiny_cpu.py` with `OVERRIDES`."""
    cd = tiny_cpu.get_config()
    for name, value in OVERRIDES.items():
        section, field = name.split(".")
        cd[section][field] = value
    return cd


def command_line(workdir) -> list[str]:
    """`python -m experiments.main` with `OVERRIDES` as `--config.<field>=` flags (run it with
    `cwd=ROOT`)."""
    flags = [f"--config.{name}={value}" for name, value in OVERRIDES.items()]
    return [sys.executable, "-m", "experiments.main", "--config=configs/tiny_cpu.py", *flags,
            f"--workdir={workdir}"]  # fmt: skip


def logged_rows(workdir) -> list[dict]:
    """`rl_metrics.jsonl` without the timings (which differ from run to run)."""
    rows = read_rows(os.path.join(workdir, "rl_metrics.jsonl"), missing_ok=True)
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def final_state(workdir) -> list[np.ndarray]:
    """The parameters and optimizer state of the run's final checkpoint, as host arrays."""
    config = ExperimentConfig.from_config_dict(config_dict())
    with RLLoop(config, str(workdir)) as loop:
        assert loop.restore() == STEPS
        state = (nnx.state(loop.model, nnx.Param), nnx.state(loop.optimizer))
        return [np.asarray(x) for x in jax.tree.leaves(state)]


def assert_same_run(workdir, reference) -> None:
    """`workdir`'s metric rows and final state equal `reference`'s (`ReferenceRun`) exactly: the
    same machine runs the same compiled steps on the same data."""
    assert logged_rows(workdir) == reference.rows
    got = final_state(workdir)
    assert len(got) == len(reference.state)
    for a, b in zip(got, reference.state, strict=True):
        np.testing.assert_array_equal(a, b)
