"""GRPO step time of several methods, split into rollout, guidance I/O and training.

Each method runs `steps` plain GRPO steps (no evaluation, no mismatch steps: only the steady
loop) from the same random initialization in `<workdir>/<method>` (`run_method`); `report` takes
the median per-step time of each phase over the steps after the first `skip` (compilation) from
each run's `rl_metrics.jsonl`, and each method's step time over the reference method's, with the
kernels its rollout ran (`rollout_implementation`: `rl.rollout_implementation` as the run's
process resolved it, "pallas" or "xla").

From a random initialization no row stops early, so every method samples full-length responses:
equal work per step, which a side-by-side timing needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence

import jax
import numpy as np

from trace_jax.models import resolve_implementation
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.loop import RLLoop
from trace_jax.rl.metrics_log import read_rows

PHASES = ("time_rollout_s", "time_guidance_io_s", "time_train_s")
# The guidance I/O's parts: the write still committing when the trainer needs it, the read, and
# the wait for the previous step's deletion (logs of older runs lack the last).
GUIDANCE_IO_PARTS = ("time_guidance_write_s", "time_guidance_read_s", "time_guidance_delete_wait_s")
# What a timing run's process records beside its logs: the rollout's kernels, its peak memory.
RUN_FILE = "step_time_run.json"
PROFILE_DIR = "profile"  # `run_method`'s profiler trace, beside the run's logs


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTimeConfig:
    """The `step_time` section of a step-time config.

    methods: the methods timed (names of `trace_jax.rl.methods.METHODS`).
    steps: GRPO steps per method.
    skip: first steps left out of the medians (compilation).
    reference: the method the others are compared to ("": the last of `methods`).
    profile_steps: steps after the timed ones, in the same run (so with its functions
      compiled), under `jax.profiler` into `<workdir>/<method>/profile` (a TensorBoard /
      Perfetto trace of steady steps: which kernels, host gaps); not in the medians. 0: none.
    """

    methods: tuple[str, ...] = ("trace", "fp4_qat")
    steps: int = 25
    skip: int = 2
    reference: str = ""
    profile_steps: int = 0

    def __post_init__(self):
        object.__setattr__(self, "methods", tuple(self.methods))
        if not self.methods:
            raise ValueError("step_time.methods is empty: name at least one method")
        if self.reference and self.reference not in self.methods:
            raise ValueError(
                f"step_time.reference {self.reference!r} is not among the methods "
                f"{list(self.methods)}"
            )
        if self.profile_steps < 0:
            raise ValueError(f"step_time.profile_steps must be >= 0, got {self.profile_steps}")
        if self.steps <= self.skip:
            raise ValueError(
                f"step_time.steps={self.steps} leaves no step after the first skip={self.skip}"
            )

    @property
    def reference_method(self) -> str:
        return self.reference or self.methods[-1]


def method_config(config: ExperimentConfig, method: str, steps: int) -> ExperimentConfig:
    """`config` for a timing run of `method`: `steps` plain GRPO steps from a random
    initialization, nothing else timed (no evaluation, no mismatch steps, one checkpoint)."""
    rl = dataclasses.replace(
        config.rl,
        method=method,
        steps=steps,
        eval_every=0,
        mismatch_every=0,
        init_from="",
        checkpoint_every=steps,
    )
    return dataclasses.replace(config, rl=rl)


def run_method(
    config: ExperimentConfig,
    workdir: str,
    method: str,
    steps: int,
    record_memory: bool = False,
    profile_steps: int = 0,
) -> None:
    """Runs `method` in `<workdir>/<method>` for `steps` steps, then `profile_steps` more under
    `jax.profiler.trace` into `<workdir>/<method>/profile`, and writes
    `<workdir>/<method>/step_time_run.json`: the rollout's kernels as this process resolves
    `rl.rollout_implementation` (what its `RolloutWorker` ran) and, with `record_memory` (a
    process of its own), the device's peak memory over the run where the backend reports it
    (GPUs do, the CPU does not).

    One run of `steps + profile_steps` steps: the profiled steps are its last, so they run the
    functions the timed steps compiled (a run of another length has another learning-rate
    schedule, so another compiled update)."""
    directory = os.path.join(workdir, method)
    with contextlib.ExitStack() as profiling:

        def before_step(step: int) -> None:
            if profile_steps and step == steps:
                profiling.enter_context(jax.profiler.trace(os.path.join(directory, PROFILE_DIR)))

        RLLoop(method_config(config, method, steps + profile_steps), directory).run(
            before_step=before_step
        )
    record = {"rollout_implementation": resolve_implementation(config.rl.rollout_implementation)}
    stats = jax.local_devices()[0].memory_stats() if record_memory else None
    if stats and "peak_bytes_in_use" in stats:
        record["peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
    with open(os.path.join(directory, RUN_FILE), "w") as f:
        json.dump(record, f)


def step_times(rows: Sequence[dict], skip: int, steps: int | None = None) -> dict[str, float]:
    """Median seconds per phase and per step over the steps after the first `skip` and before
    `steps` (None: all; the profiled steps after them are left out), the guidance I/O parts
    where every step logged them, `steps_timed` and the mean `reward`."""
    steady = [r for r in rows if skip <= r["step"] and (steps is None or r["step"] < steps)]
    if not steady:
        raise ValueError(f"no steps after the first {skip} to time (got {len(rows)} steps)")
    out = {k: float(np.median([r[k] for r in steady])) for k in PHASES}
    out["time_step_s"] = float(np.median([sum(r[k] for k in PHASES) for r in steady]))
    for k in GUIDANCE_IO_PARTS:
        if all(k in r for r in steady):
            out[k] = float(np.median([r[k] for r in steady]))
    out["steps_timed"] = len(steady)
    out["reward"] = float(np.mean([r["reward"] for r in steady]))
    return out


def report(
    workdir: str, methods: Sequence[str], skip: int, reference: str, steps: int | None = None
) -> list[dict]:
    """One row per method from `<workdir>/<method>/rl_metrics.jsonl` and `step_time_run.json`:
    the rollout's kernels (`rollout_implementation`), `step_times` (over steps `[skip,
    steps)`), the peak device memory
    (`peak_memory_gib`) where recorded, the guidance I/O share of the step and the step time
    relative to `reference`'s (`step_vs_reference`)."""
    rows = []
    for m in methods:
        logged = read_rows(os.path.join(workdir, m, "rl_metrics.jsonl"))
        with open(os.path.join(workdir, m, RUN_FILE)) as f:
            record = json.load(f)
        rows.append(
            {
                "method": m,
                "rollout_implementation": record["rollout_implementation"],
                **step_times(logged, skip, steps),
            }
        )
        if "peak_bytes_in_use" in record:
            rows[-1]["peak_memory_gib"] = record["peak_bytes_in_use"] / 2**30
    ref = next(r for r in rows if r["method"] == reference)
    for r in rows:
        r["guidance_io_share"] = r["time_guidance_io_s"] / r["time_step_s"]
        r["step_vs_reference"] = r["time_step_s"] / ref["time_step_s"]
    return rows
