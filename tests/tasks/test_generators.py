"""Generators: every worked solution verifies, is consistent, deterministic and within bounds
(the short-response tasks here; the loop programs in `test_loop.py`)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from trace_jax import tasks
from trace_jax.tasks import countdown, expr, program
from trace_jax.tasks.tokenizer import ANSWER_MARKER

N_PER_LEVEL = 150
CASES = [(task, level) for task in tasks.SHORT_TASKS for level in tasks.LEVELS]


def _problems(task, level, n=N_PER_LEVEL, seed=0):
    rng = np.random.default_rng([seed, tasks.LEVELS.index(level), tasks.TASKS.index(task)])
    return [tasks.generate(task, rng, level) for _ in range(n)]


@pytest.mark.parametrize(("task", "level"), CASES)
def test_worked_solution_earns_full_reward(task, level):
    for p in _problems(task, level):
        assert p.task == task and p.difficulty == level
        assert tasks.reward(p, tasks.solution_ids(p)) == 1.0, p
        assert tasks.reward(p, p.solution) == 1.0, p
        assert tasks.extract_answer(tasks.solution_ids(p)) == p.answer
        assert p.solution.endswith(ANSWER_MARKER + p.answer)


@pytest.mark.parametrize(("task", "level"), CASES)
def test_length_caps(task, level):
    spec = tasks.level_spec(task, level)
    for p in _problems(task, level, seed=1):
        assert len(tasks.prompt_ids(p)) == p.prompt_tokens <= spec.max_prompt_tokens
        assert len(tasks.solution_ids(p)) == p.solution_tokens <= spec.max_solution_tokens
    if level == 1:  # what the tiny model must fit at the easiest level
        assert spec.max_prompt_tokens <= 24 and spec.max_solution_tokens <= 40


@pytest.mark.parametrize("task", tasks.TASKS)
def test_deterministic_in_the_seed(task):
    for level in tasks.LEVELS:
        assert tasks.generate(task, 123, level) == tasks.generate(task, 123, level)
        a = [tasks.generate(task, np.random.default_rng(7), level) for _ in range(2)]
        assert a[0] == a[1]
    prompts = {p.prompt for p in _problems(task, 3, n=50)}
    assert len(prompts) > 45  # varied


@pytest.mark.parametrize("task", tasks.TASKS)
def test_bad_level_raises(task):
    for level in (0, 6, True, "1"):
        with pytest.raises(ValueError, match="level"):
            tasks.generate(task, 0, level)


def test_unknown_task_raises():
    with pytest.raises(ValueError, match="unknown task"):
        tasks.generate("sudoku", 0, 1)


@pytest.mark.parametrize("level", tasks.LEVELS)
def test_arithmetic_steps_are_consistent(level):
    spec = tasks.level_spec("arithmetic", level)
    for p in _problems("arithmetic", level, seed=2):
        question = expr.parse(p.prompt.removesuffix("="))
        assert expr.count_ops(question) == spec.n_ops
        steps = p.solution.split(ANSWER_MARKER)[0].split("=")
        assert len(steps) == spec.n_ops
        for s in steps:  # every rewrite keeps the value, one operation fewer each time
            assert expr.evaluate(expr.parse(s)) == int(p.answer)
        assert [expr.count_ops(expr.parse(s)) for s in steps] == list(range(spec.n_ops - 1, -1, -1))


@pytest.mark.parametrize("level", tasks.LEVELS)
def test_countdown_construction(level):
    spec = tasks.level_spec("countdown", level)
    for p in _problems("countdown", level, seed=3):
        target, numbers = countdown.parse_prompt(p.prompt)
        assert len(numbers) == len(set(numbers)) == spec.n_numbers
        assert target not in numbers and 0 < target <= spec.max_value
        tree = expr.parse(p.answer, allow_negative=False)
        used = expr.leaves(tree)
        assert len(used) == spec.n_used and not collections.Counter(used) - collections.Counter(
            numbers
        )
        assert expr.evaluate(tree) == target
        work = p.solution.split(ANSWER_MARKER)[0].split(",")
        assert len(work) == spec.n_used - 1
        assert work[-1].endswith(f"={target}")
        for step in work:  # each "a op b=c" is right
            lhs, rhs = step.split("=")
            assert expr.evaluate(expr.parse(lhs)) == int(rhs) > 0


@pytest.mark.parametrize("level", tasks.LEVELS)
def test_program_trace_matches_an_interpreter(level):
    spec = tasks.level_spec("program", level)
    for p in _problems("program", level, seed=4):
        env = program.run(p.prompt)
        query = p.prompt[-1]
        assert str(env[query]) == p.answer
        trace = p.solution.split(ANSWER_MARKER)[0].split(",")
        assert len(trace) == spec.n_stmts == p.prompt.count(";")
        final = dict(entry.split("=") for entry in trace)
        assert {k: int(v) for k, v in final.items()} == env
        if not spec.query_any:
            assert trace[-1].startswith(query + "=")


def test_program_interpreter_rejects_malformed():
    for bad in ("a=1;b=c+1;?b", "a=1;a", "a=01;?a", "a=1/2;?a", "a=1;?ab"):
        with pytest.raises(ValueError):
            program.run(bad)


def test_problem_validation():
    ok = dict(task="arithmetic", prompt="1+2=", answer="3", solution="3>3", difficulty=1)
    assert tasks.Problem(**ok).task is tasks.TaskKind.ARITHMETIC
    for bad in (
        dict(solution="3>4"),
        dict(difficulty=9),
        dict(answer=""),
        dict(prompt="1>2="),
        dict(solution="3>3>3", answer="3"),
        dict(prompt="1+X="),
    ):
        with pytest.raises(ValueError):
            tasks.Problem(**{**ok, **bad})
