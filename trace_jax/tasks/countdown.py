"""Countdown: reach a target with `+ - * /` from given numbers, each used at most once.

    prompt    40 from 3,12,7,4:
    solution  7+3=10,10*4=40>(7+3)*4

The answer is an expression over the given numbers (parentheses allowed, no unary minus, no
number used more often than it is given, division only when exact) that evaluates to the
target. Problems are built from a random expression over some of the numbers, so a solution
always exists; its steps are the worked solution. Intermediates stay positive when generated;
the verifier accepts any valid expression.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

from trace_jax.tasks import expr
from trace_jax.tasks.problem import Problem, TaskKind, as_generator, check_level, sample_until
from trace_jax.tasks.tokenizer import ANSWER_MARKER

_PROMPT = re.compile(r"([1-9][0-9]*) from ([1-9][0-9]*(?:,[1-9][0-9]*)*):")
MAX_ANSWER_CHARS = 64  # longer answers are rejected unparsed


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownLevel:
    """Difficulty knobs.

    Attributes:
      n_numbers: numbers given (distinct, from [1, max_number]).
      n_used: numbers the generating expression uses (the rest are distractors).
      max_number: largest given number.
      ops: operators the generator may use (the verifier accepts all four).
      max_value: bound on the target and every generated intermediate.
      max_prompt_tokens, max_solution_tokens: length caps (BOS / EOS included).
    """

    n_numbers: int
    n_used: int
    max_number: int
    ops: str
    max_value: int
    max_prompt_tokens: int
    max_solution_tokens: int


LEVELS = {
    1: CountdownLevel(
        n_numbers=3, n_used=2, max_number=10, ops="+-*", max_value=99, max_prompt_tokens=16,
        max_solution_tokens=16,
    ),
    2: CountdownLevel(
        n_numbers=3, n_used=3, max_number=12, ops="+-*", max_value=199, max_prompt_tokens=18,
        max_solution_tokens=32,
    ),
    3: CountdownLevel(
        n_numbers=4, n_used=3, max_number=20, ops="+-*/", max_value=499, max_prompt_tokens=22,
        max_solution_tokens=36,
    ),
    4: CountdownLevel(
        n_numbers=4, n_used=4, max_number=20, ops="+-*/", max_value=999, max_prompt_tokens=22,
        max_solution_tokens=48,
    ),
    5: CountdownLevel(
        n_numbers=5, n_used=5, max_number=25, ops="+-*/", max_value=999, max_prompt_tokens=26,
        max_solution_tokens=64,
    ),
}  # fmt: skip


def generate(seed: int | np.random.Generator, level: int) -> Problem:
    """A problem at difficulty `level`; a pure function of the seed / Generator state."""
    check_level(level, LEVELS)
    spec = LEVELS[level]
    rng = as_generator(seed)
    return sample_until(rng, lambda r: _attempt(r, level, spec), what=f"countdown L{level}")


def _combine(op: str, a: expr.Node, b: expr.Node, max_value: int) -> expr.Node | None:
    """`a op b` as a node with a positive value <= max_value, operands swapped if that helps;
    None when `op` gives nothing useful (a zero, a fraction, `*1`, `/1`)."""
    va, vb = expr.evaluate(a), expr.evaluate(b)
    if op in "-/" and va < vb:
        a, b, va, vb = b, a, vb, va
    if op == "-" and va == vb:
        return None
    if op == "/" and (vb == 1 or va % vb):
        return None
    if op == "*" and 1 in (va, vb):
        return None
    value = expr.apply(op, va, vb)
    if not 0 < value <= max_value:
        return None
    return expr.BinOp(op, a, b)


def _attempt(rng: np.random.Generator, level: int, spec: CountdownLevel) -> Problem | None:
    numbers = [int(v) for v in rng.choice(np.arange(1, spec.max_number + 1), spec.n_numbers, False)]
    used = rng.permutation(spec.n_numbers)[: spec.n_used]
    nodes: list[expr.Node] = [expr.Num(numbers[int(i)]) for i in used]
    while len(nodes) > 1:
        i, j = (int(k) for k in rng.choice(len(nodes), 2, replace=False))
        node = _combine(str(rng.choice(list(spec.ops))), nodes[i], nodes[j], spec.max_value)
        if node is None:
            return None
        nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [node]
    tree = nodes[0]
    target = expr.evaluate(tree)
    if target in numbers:
        return None
    steps = expr.reduction_steps(tree)
    answer = expr.to_text(tree)
    work = ",".join(f"{s.a}{s.op}{s.b}={s.value}" for s in steps)
    problem = Problem(
        task=TaskKind.COUNTDOWN,
        prompt=f"{target} from {','.join(map(str, numbers))}:",
        answer=answer,
        solution=work + ANSWER_MARKER + answer,
        difficulty=level,
    )
    if (
        problem.prompt_tokens > spec.max_prompt_tokens
        or problem.solution_tokens > spec.max_solution_tokens
    ):
        return None
    return problem


def parse_prompt(prompt: str) -> tuple[int, tuple[int, ...]]:
    """(target, numbers) of a countdown prompt; ValueError if it is not one."""
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        raise ValueError(f"{prompt!r} is not a countdown prompt ('<target> from <n>,<n>,...:')")
    return int(match[1]), tuple(int(v) for v in match[2].split(","))


def is_well_formed(answer: str) -> bool:
    """Whether `answer` parses as a countdown expression (its value is not checked)."""
    try:
        expr.parse(answer, allow_negative=False, max_len=MAX_ANSWER_CHARS)
    except expr.ExprError:
        return False
    return True


def check_answer(prompt: str, reference: str, answer: str) -> bool:
    """Whether `answer` uses only the prompt's numbers, each at most as often as given, and
    evaluates exactly (exact divisions only) to the target. Never raises on bad `answer`."""
    del reference
    target, numbers = parse_prompt(prompt)
    try:
        tree = expr.parse(answer, allow_negative=False, max_len=MAX_ANSWER_CHARS)
        if collections.Counter(expr.leaves(tree)) - collections.Counter(numbers):
            return False
        return expr.evaluate(tree) == target
    except expr.ExprError:
        return False
