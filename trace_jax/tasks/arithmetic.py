"""Multi-step arithmetic: evaluate `3+4*2-5=`, showing one reduction per step.

    prompt    3+4*2-5=
    solution  3+8-5=11-5=6>6

Operators `+ - *` with the usual precedence, left to right; from level 3 on a sub-expression may be
parenthesized. Each step evaluates the first operation in evaluation order and rewrites the whole
expression (a negative intermediate is written `(-2)` unless it leads). The answer is the integer
in canonical form (`-14`, `0`, no leading zeros or `+`).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from trace_jax.tasks import expr
from trace_jax.tasks.problem import Problem, TaskKind, as_generator, check_level, sample_until
from trace_jax.tasks.tokenizer import ANSWER_MARKER

_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticLevel:
    """Difficulty knobs.

    Attributes:
      n_ops: operations in the expression (= reduction steps).
      max_operand: operands are drawn from [0, max_operand].
      paren_prob: probability of parenthesizing a random sub-span of operands.
      max_abs: every intermediate value has |v| <= max_abs (rejection sampling).
      max_prompt_tokens, max_solution_tokens: length caps (BOS / EOS included).
    """

    n_ops: int
    max_operand: int
    paren_prob: float
    max_abs: int
    max_prompt_tokens: int
    max_solution_tokens: int


LEVELS = {
    1: ArithmeticLevel(
        n_ops=2, max_operand=9, paren_prob=0.0, max_abs=99, max_prompt_tokens=8,
        max_solution_tokens=16,
    ),
    2: ArithmeticLevel(
        n_ops=3, max_operand=9, paren_prob=0.0, max_abs=999, max_prompt_tokens=10,
        max_solution_tokens=28,
    ),
    3: ArithmeticLevel(
        n_ops=4, max_operand=19, paren_prob=0.5, max_abs=999, max_prompt_tokens=20,
        max_solution_tokens=52,
    ),
    4: ArithmeticLevel(
        n_ops=5, max_operand=19, paren_prob=0.6, max_abs=9999, max_prompt_tokens=24,
        max_solution_tokens=80,
    ),
    5: ArithmeticLevel(
        n_ops=6, max_operand=29, paren_prob=0.7, max_abs=9999, max_prompt_tokens=28,
        max_solution_tokens=104,
    ),
}  # fmt: skip


def generate(seed: int | np.random.Generator, level: int) -> Problem:
    """A problem at difficulty `level`; a pure function of the seed / Generator state."""
    check_level(level, LEVELS)
    spec = LEVELS[level]
    rng = as_generator(seed)
    return sample_until(rng, lambda r: _attempt(r, level, spec), what=f"arithmetic L{level}")


def _attempt(rng: np.random.Generator, level: int, spec: ArithmeticLevel) -> Problem | None:
    operands = [str(int(v)) for v in rng.integers(0, spec.max_operand + 1, spec.n_ops + 1)]
    ops = [str(o) for o in rng.choice(list("+-*"), spec.n_ops)]
    if rng.random() < spec.paren_prob:
        start = int(rng.integers(0, spec.n_ops))  # span [start, stop] of >= 2 operands
        stop = int(rng.integers(start + 1, spec.n_ops + 1))
        if (start, stop) != (0, spec.n_ops):
            operands[start] = "(" + operands[start]
            operands[stop] = operands[stop] + ")"
    text = operands[0] + "".join(o + v for o, v in zip(ops, operands[1:], strict=True))
    tree = expr.parse(text)
    steps = expr.reduction_steps(tree)
    if any(abs(s.value) > spec.max_abs for s in steps):
        return None
    answer = str(steps[-1].value)
    prompt = expr.to_text(tree) + "="
    solution = "=".join(expr.to_text(s.tree) for s in steps) + ANSWER_MARKER + answer
    problem = Problem(
        task=TaskKind.ARITHMETIC, prompt=prompt, answer=answer, solution=solution, difficulty=level
    )
    if (
        problem.prompt_tokens > spec.max_prompt_tokens
        or problem.solution_tokens > spec.max_solution_tokens
    ):
        return None
    return problem


def is_well_formed(answer: str) -> bool:
    """Whether `answer` is an integer in canonical form."""
    return _INT.fullmatch(answer) is not None


def check_answer(prompt: str, reference: str, answer: str) -> bool:
    """Exact match with the reference integer."""
    del prompt
    return answer == reference
