"""Fault injection for recovery tests: `TRACE_JAX_FAULT=<point>:<step>` kills the process with
SIGKILL (as `kill -9` would) when a run reaches `point` at RL step `step`.

  TRACE_JAX_FAULT=guidance_write:2 python -m experiments.main --config=configs/tiny_cpu.py

Points, each one `maybe_die(point, step)` call in the library:
  rollout          `RLLoop.run`: the step's rollout is sampled; nothing of the step is written.
  guidance_write   `GuidanceWriter.commit`, an entry of the step: its data chunks are written,
                   its manifest (the commit) is not (on the writer's background thread).
  checkpoint_save  `checkpoint.save_step`: the step's asynchronous checkpoint save has started and
                   is not waited for (orbax finishes and commits it on a background thread).

The point is a place in the program, not a moment, so a test kills a run at the same place every
time. Unset (every normal run) a call costs one environment lookup. A value that is not
`<point>:<step>` with a known point raises ValueError at the first call, so a misspelt fault
cannot let a test pass without it. This module imports nothing of the project: the guidance
store and the RL loop both call it.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "TRACE_JAX_FAULT"
POINTS = ("rollout", "guidance_write", "checkpoint_save")


def parse_fault(spec: str) -> tuple[str, int]:
    """(point, step) of a `TRACE_JAX_FAULT` value `<point>:<step>`; ValueError naming the value
    otherwise."""
    point, sep, step = spec.partition(":")
    if not sep or point not in POINTS or not step.isdigit():
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected <point>:<step> with a point of {POINTS} and a "
            "step >= 0, e.g. 'rollout:1'"
        )
    return point, int(step)


def maybe_die(point: str, step: int) -> None:
    """Kills this process with SIGKILL when `TRACE_JAX_FAULT` names `point` at `step`."""
    spec = os.environ.get(FAULT_ENV)
    if spec and parse_fault(spec) == (point, step):
        os.kill(os.getpid(), signal.SIGKILL)
