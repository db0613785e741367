"""Task kind -> generator, answer checker and answer-format check (one table for all callers)."""

from __future__ import annotations

import numpy as np

from trace_jax.tasks import arithmetic, countdown, loop, program
from trace_jax.tasks.problem import Problem, TaskKind, check_level

_MODULES = {
    TaskKind.ARITHMETIC: arithmetic,
    TaskKind.COUNTDOWN: countdown,
    TaskKind.PROGRAM: program,
    TaskKind.LOOP: loop,
}
TASKS = tuple(_MODULES)


def generate(task: TaskKind | str, seed: int | np.random.Generator, level: int) -> Problem:
    """A `task` problem at difficulty `level` (a pure function of the seed / Generator state)."""
    return _module(task).generate(seed, level)


def level_spec(task: TaskKind | str, level: int):
    """The frozen difficulty-knob record of `task` at `level` (lengths caps included)."""
    levels = _module(task).LEVELS
    check_level(level, levels)
    return levels[level]


def check_answer(problem: Problem, answer: str) -> bool:
    """Whether the extracted `answer` text solves `problem` (never raises on bad answers)."""
    return _module(problem.task).check_answer(problem.prompt, problem.answer, answer)


def is_well_formed(task: TaskKind | str, answer: str) -> bool:
    """Whether `answer` has the syntax of a `task` answer, right or wrong."""
    return _module(task).is_well_formed(answer)


def _module(task: TaskKind | str):
    try:
        return _MODULES[TaskKind(task)]
    except ValueError:
        raise ValueError(
            f"unknown task {task!r}; expected one of {[str(t) for t in TASKS]}"
        ) from None
