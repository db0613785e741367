"""What a workdir was made with: each stage records its resolved config at its first start, and a
rerun with another config is refused instead of resuming or reusing what it does not match.

  guard_workdir(workdir, "rl", config)    # RLLoop.run; "sft": run_sft; the disaggregated runner
  move_aside(workdir)                     # start fresh: the entry points' --fresh

`<workdir>/sft_config.json` (the SFT stage) and `<workdir>/rl_config.json` (an RL run, by
`RLLoop` or the disaggregated runner) hold the stage's settings under the ConfigDict's dotted
names (`sft.steps`, `rl.method`, `model.n_layers`: the model resolved from its preset), written
atomically at the stage's first start. A rerun compares its own settings with the record:
  * equal: it resumes (RL) or reuses (a finished SFT stage);
  * changed only in settings `SAFE_CHANGES` allows (more RL steps, evaluation and checkpoint
    cadence, ...): it proceeds, logs each change and records the new settings;
  * anything else: `WorkdirConfigError` names each changed setting, old -> new.
A stage whose outputs exist without a record (written before records existed) is refused too:
nothing can tell what made it. `move_aside` renames a workdir to `<workdir>.old-<n>` (nothing is
deleted); it refuses paths that do not hold a stage record (a home directory, the current one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

from trace_jax.rl.experiment import ExperimentConfig

log = logging.getLogger(__name__)

# Stage -> the record file and the settings sections it holds. The SFT stage's are what its
# checkpoint and its evaluation depend on; an RL run's what its rollouts, updates and
# evaluations do (the SFT start reaches it through `rl.init_from`, a path).
STAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sft": ("sft_config.json", ("seed", "model", "tasks", "sft", "eval")),
    "rl": ("rl_config.json", ("seed", "model", "tasks", "eval", "rl", "mesh")),
    "disaggregated": (
        "rl_config.json",
        ("seed", "model", "tasks", "eval", "rl", "mesh", "disaggregated"),
    ),
}
# What a stage leaves in its workdir once it has run (a record should be beside them).
_OUTPUTS = {
    "sft": ("sft_metrics.jsonl", "sft_checkpoint", "sft_eval.json"),
    "rl": ("rl_metrics.jsonl", "rl_eval.jsonl"),
    "disaggregated": ("rl_metrics.jsonl", "rollout_log.jsonl"),
}
NOT_RECORDED = "<not recorded>"


@dataclasses.dataclass(frozen=True)
class SafeChange:
    """A setting a rerun may change in a workdir: `allows(old, new)`, and why that is safe."""

    reason: str
    allows: Callable[[Any, Any], bool] = lambda old, new: True


def _more(old, new) -> bool:
    return isinstance(old, int) and isinstance(new, int) and new > old


_CADENCE = "when the next steps log, evaluate or save; the steps already run stay as they were"
# Dotted setting -> the changes of it a rerun may make in a workdir (and why).
SAFE_CHANGES: dict[str, SafeChange] = {
    "rl.steps": SafeChange(
        "more steps continue the run from its last checkpoint (the learning-rate schedule is "
        "re-derived for the new total from there on)",
        _more,
    ),
    "rl.eval_every": SafeChange(_CADENCE),
    "rl.checkpoint_every": SafeChange(_CADENCE),
    # The rollout records full codes on measuring steps and derives the same guidance from them.
    "rl.mismatch_every": SafeChange(_CADENCE),
    "sft.log_every": SafeChange(_CADENCE),
    "model.grouped_matmul": SafeChange("how the experts' matmul runs: same numbers either way"),
    "model.remat": SafeChange("whether the backward recomputes activations: same numbers"),
    "mesh.data": SafeChange("the restored state is placed on the new mesh"),
    "mesh.expert": SafeChange("the restored state is placed on the new mesh"),
    "disaggregated.timeout_s": SafeChange("how long a process waits for the other"),
    "disaggregated.heartbeat_timeout_s": SafeChange("how long a process waits for the other"),
}


class WorkdirConfigError(ValueError):
    """A workdir holds a stage made with other settings. changes: setting -> (old, new) for
    each refused change; empty when the stage's outputs have no record at all."""

    def __init__(self, workdir: str, stage: str, changes: dict[str, tuple[Any, Any]]):
        self.workdir, self.stage, self.changes = workdir, stage, changes
        listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
        made = f"other settings ({listed})" if changes else "settings it did not record"
        super().__init__(
            f"{workdir} holds a {stage} stage made with {made}; rerun with its settings, start "
            "fresh (--fresh: `trace_jax.rl.workdir.move_aside`) or use another workdir"
        )


def stage_settings(config: ExperimentConfig, stage: str) -> dict[str, Any]:
    """`{"stage": stage, setting: value}`: the settings `stage` records, under the ConfigDict's
    dotted names, as JSON values (tuples as lists, dtypes by name, paths absolute)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {sorted(STAGES)}")
    out: dict[str, Any] = {"stage": stage}
    for section in STAGES[stage][1]:
        if section == "seed":
            out["seed"] = config.seed
            continue
        values = dataclasses.asdict(getattr(config, section))
        if section == "model" and config.model_hf_dir:  # recorded only when set
            values["hf_dir"] = os.path.abspath(config.model_hf_dir)
        if section == "rl":
            values |= values.pop("grpo")
            values["init_from"] = values["init_from"] and os.path.abspath(values["init_from"])
        out |= {f"{section}.{k}": v for k, v in values.items()}
    return json.loads(json.dumps(out, default=str))


def record_path(workdir: str, stage: str) -> str:
    return os.path.join(workdir, STAGES[stage][0])


def recorded_settings(workdir: str, stage: str) -> dict[str, Any] | None:
    """The settings recorded for `stage` in `workdir`, or None."""
    try:
        with open(record_path(workdir, stage)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _write(path: str, settings: dict[str, Any]) -> None:
    """Writes `settings` to `path` atomically: readers see the old record or the new one."""
    # A name of its own: the two processes (or threads) of a disaggregated run record at once.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".record.")
    with os.fdopen(fd, "w") as f:
        json.dump(settings, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _has_outputs(workdir: str, stage: str) -> bool:
    return any(os.path.exists(os.path.join(workdir, name)) for name in _OUTPUTS[stage])


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Setting -> (old, new) for each setting that differs (`NOT_RECORDED` where one lacks it)."""
    keys = sorted(set(old) | set(new), key=lambda k: (k != "stage", k))
    return {
        k: (old.get(k, NOT_RECORDED), new.get(k, NOT_RECORDED))
        for k in keys
        if old.get(k, NOT_RECORDED) != new.get(k, NOT_RECORDED)
    }


def guard_workdir(workdir: str, stage: str, config: ExperimentConfig) -> None:
    """Records `config`'s settings of `stage` in `workdir` at its first start; on a rerun,
    refuses (`WorkdirConfigError`) unless the settings are the recorded ones or differ only as
    `SAFE_CHANGES` allows (then the new ones are recorded). Creates `workdir` if needed."""
    new = stage_settings(config, stage)
    # Outputs first: a stage writes its record before any output, so a record written by a
    # partner process that is already producing outputs is seen.
    has_outputs = _has_outputs(workdir, stage)
    old = recorded_settings(workdir, stage)
    if old is None and has_outputs:
        raise WorkdirConfigError(workdir, stage, {})
    if old is not None:
        changes = changed_settings(old, new)
        refused = {
            k: v
            for k, v in changes.items()
            if k not in SAFE_CHANGES or not SAFE_CHANGES[k].allows(*v)
        }
        if refused:
            raise WorkdirConfigError(workdir, stage, refused)
        if not changes:
            return
        for k, (was, now) in changes.items():
            why = SAFE_CHANGES[k].reason
            log.warning("%s: %s %r -> %r accepted: %s", workdir, k, was, now, why)
    os.makedirs(workdir, exist_ok=True)
    _write(record_path(workdir, stage), new)


def _holds_records(path: str) -> bool:
    """Whether `path` or a directory right under it holds a stage record."""
    records = {name for name, _ in STAGES.values()}
    dirs = [path] + [e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    return any(os.path.exists(os.path.join(d, name)) for d in dirs for name in records)


def move_aside(workdir: str) -> str | None:
    """Renames `workdir` to `<workdir>.old-<n>` (the first free n) so that a run starts fresh
    there; returns the new path, or None when `workdir` does not exist. Refuses (ValueError) a
    path that is a link, the current directory or one above it, or that holds no stage record
    here or one level down (it is not a workdir of these runs)."""
    if not os.path.lexists(workdir):
        return None
    real, here = os.path.realpath(workdir), os.path.realpath(os.getcwd())
    if os.path.islink(workdir) or not os.path.isdir(real):
        raise ValueError(f"--fresh moves only a workdir directory; {workdir} is not one")
    if os.path.commonpath([real, here]) == real:
        raise ValueError(f"--fresh will not move {workdir}: it holds the current directory")
    if not _holds_records(real):
        raise ValueError(
            f"--fresh will not move {workdir}: it holds no stage record ("
            f"{', '.join(sorted({n for n, _ in STAGES.values()}))}), so it may not be a workdir; "
            "move it yourself"
        )
    n = 1
    while os.path.lexists(f"{real}.old-{n}"):
        n += 1
    os.rename(real, f"{real}.old-{n}")
    log.warning("moved %s aside to %s.old-%d", workdir, real, n)
    return f"{real}.old-{n}"
