"""Straight-line programs (the LiveCodeBench stand-in): run assignments, report one variable.

    prompt    a=3;b=a*2;c=b-1;?c
    solution  a=3,b=6,c=5>5

Each statement assigns a constant or `x op y` (`+ - *`, operands earlier variables or constants)
to a one-letter variable; later levels reassign variables (`a=a+b`) and query any variable, not
only the last one written. The worked solution is the execution trace, one `name=value` per
statement; the answer is the queried integer in canonical form.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from trace_jax.tasks.problem import Problem, TaskKind, as_generator, check_level, sample_until
from trace_jax.tasks.tokenizer import ANSWER_MARKER

NAMES = "abcdefghij"
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramLevel:
    """Difficulty knobs.

    Attributes:
      n_stmts: statements in the program (= trace entries).
      max_const: constants are drawn from [0, max_const] ([2, max_const] as operands).
      ops: binary operators used.
      const_prob: probability that a statement after the first assigns a constant (the last
        statement always computes).
      reassign_prob: probability that a statement writes an already defined variable.
      query_any: query a random computed variable (else the last one written).
      max_abs: every value has |v| <= max_abs (rejection sampling).
      max_prompt_tokens, max_solution_tokens: length caps (BOS / EOS included).
    """

    n_stmts: int
    max_const: int
    ops: str
    const_prob: float
    reassign_prob: float
    query_any: bool
    max_abs: int
    max_prompt_tokens: int
    max_solution_tokens: int


LEVELS = {
    1: ProgramLevel(
        n_stmts=3, max_const=9, ops="+-", const_prob=0.2, reassign_prob=0.0, query_any=False,
        max_abs=99, max_prompt_tokens=20, max_solution_tokens=20,
    ),
    2: ProgramLevel(
        n_stmts=4, max_const=9, ops="+-*", const_prob=0.2, reassign_prob=0.0, query_any=False,
        max_abs=999, max_prompt_tokens=28, max_solution_tokens=32,
    ),
    3: ProgramLevel(
        n_stmts=5, max_const=9, ops="+-*", const_prob=0.2, reassign_prob=0.3, query_any=False,
        max_abs=999, max_prompt_tokens=36, max_solution_tokens=40,
    ),
    4: ProgramLevel(
        n_stmts=6, max_const=19, ops="+-*", const_prob=0.2, reassign_prob=0.3, query_any=True,
        max_abs=999, max_prompt_tokens=48, max_solution_tokens=48,
    ),
    5: ProgramLevel(
        n_stmts=8, max_const=19, ops="+-*", const_prob=0.2, reassign_prob=0.3, query_any=True,
        max_abs=9999, max_prompt_tokens=64, max_solution_tokens=72,
    ),
}  # fmt: skip


def generate(seed: int | np.random.Generator, level: int) -> Problem:
    """A problem at difficulty `level`; a pure function of the seed / Generator state."""
    check_level(level, LEVELS)
    spec = LEVELS[level]
    rng = as_generator(seed)
    return sample_until(rng, lambda r: _attempt(r, level, spec), what=f"program L{level}")


def _const(rng: np.random.Generator, spec: ProgramLevel, low: int = 0) -> int:
    return int(rng.integers(low, spec.max_const + 1))


def _attempt(rng: np.random.Generator, level: int, spec: ProgramLevel) -> Problem | None:
    fresh = [str(c) for c in rng.permutation(list(NAMES))]
    env: dict[str, int] = {}
    computed: set[str] = set()  # variables whose latest value came from an operation
    stmts, trace = [], []
    for k in range(spec.n_stmts):
        defined = list(env)
        if defined and rng.random() < spec.reassign_prob:
            name = str(rng.choice(defined))
        else:
            name = fresh.pop()
        is_const = k == 0 or (k < spec.n_stmts - 1 and rng.random() < spec.const_prob)
        if is_const:
            value = _const(rng, spec)
            rhs = str(value)
            computed.discard(name)
        else:
            op = str(rng.choice(list(spec.ops)))
            x = str(rng.choice(defined))
            if rng.random() < 0.5:
                y, vy = str(rng.choice(defined)), None
            else:
                vy = _const(rng, spec, low=2)  # no `+0`, `*1`
                y = str(vy)
            vx, vy = env[x], env[y] if vy is None else vy
            value = vx + vy if op == "+" else vx - vy if op == "-" else vx * vy
            rhs = f"{x}{op}{y}"
            computed.add(name)
        if abs(value) > spec.max_abs:
            return None
        env[name] = value
        stmts.append(f"{name}={rhs}")
        trace.append(f"{name}={value}")
    query = str(rng.choice(sorted(computed))) if spec.query_any else name
    answer = str(env[query])
    problem = Problem(
        task=TaskKind.PROGRAM,
        prompt=";".join(stmts) + f";?{query}",
        answer=answer,
        solution=",".join(trace) + ANSWER_MARKER + answer,
        difficulty=level,
    )
    if (
        problem.prompt_tokens > spec.max_prompt_tokens
        or problem.solution_tokens > spec.max_solution_tokens
    ):
        return None
    return problem


def run(prompt: str) -> dict[str, int]:
    """Executes a program prompt (without the query) and returns the final variables; an
    independent interpreter the tests check generated traces against. ValueError if malformed."""
    *stmts, query = prompt.split(";")
    if not re.fullmatch(r"\?[a-z]", query):
        raise ValueError(f"program {prompt!r} must end with ';?<variable>'")
    env: dict[str, int] = {}
    operand = r"([a-z]|0|[1-9][0-9]*)"
    for stmt in stmts:
        m = re.fullmatch(rf"([a-z])=(?:{operand}([-+*]){operand}|(0|[1-9][0-9]*))", stmt)
        if m is None:
            raise ValueError(f"statement {stmt!r} of {prompt!r} is malformed")
        name, x, op, y, const = m.groups()
        if const is not None:
            env[name] = int(const)
            continue
        unknown = [v for v in (x, y) if v.isalpha() and v not in env]
        if unknown:
            raise ValueError(f"statement {stmt!r} of {prompt!r} reads undefined {unknown[0]!r}")
        vx, vy = (env[v] if v.isalpha() else int(v) for v in (x, y))
        env[name] = vx + vy if op == "+" else vx - vy if op == "-" else vx * vy
    return env


def is_well_formed(answer: str) -> bool:
    """Whether `answer` is an integer in canonical form."""
    return _INT.fullmatch(answer) is not None


def check_answer(prompt: str, reference: str, answer: str) -> bool:
    """Exact match with the reference integer."""
    del prompt
    return answer == reference
