"""Loop programs (the long-response task): a few variables updated by a loop body, run for many
iterations and traced statement by statement.

    prompt    a=47;b=8;do 3:a=a+b;b=a-31;?a
    solution  1:a=47+8=55,b=55-31=24;2:a=55+24=79,b=79-31=48;3:a=79+48=27,b=27-31=96>27

Every value is an integer in [0, 100): an assignment keeps its result mod 100 (`79+48=27`,
`27-31=96`). The body assigns each variable once, in a random order, `x=y+z`, `x=y-z`, `x=y+k` or
`x=y-k` (y, z variables, z != y, k in [1, 99]); the prompt sets every variable, then `do N:`, the
body, and `?x` queries one variable after the N-th iteration. The worked solution is the
execution trace: `i:` before iteration i, each statement written with the values it reads and
the value it writes, iterations separated by `;`. The answer is the queried value. Every
variable's value flows into every other's through the body, so the answer depends on the whole
trace.

The level sets only the response length: every level draws programs the same way and runs them
for as many iterations as put the solution (EOS included) in the level's band, 96-128 tokens at
level 1 up to 1536-2048 at level 5, so a step is equally hard at every level and a response is
long because it takes many steps. A program whose state (every variable's value) repeats within
the traced iterations is rejected: its trace would cycle, and a cycle can be copied instead of
computed.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from trace_jax.tasks.problem import Problem, TaskKind, as_generator, check_level, sample_until
from trace_jax.tasks.tokenizer import ANSWER_MARKER

MODULUS = 100  # every value is kept mod MODULUS
NAMES = "abcdefgh"
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = r"(?:0|[1-9][0-9]*)"
_INIT = re.compile(rf"([a-z])=({_NUMBER})")
_STMT = re.compile(rf"([a-z])=([a-z])([-+])([a-z]|{_NUMBER})")
_PROMPT = re.compile(rf"((?:[a-z]={_NUMBER};)+)do ([1-9][0-9]*):((?:[^;?]+;)+)\?([a-z])")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopLevel:
    """Difficulty knobs.

    Attributes:
      n_vars: the numbers of variables a program may have (each drawn with equal probability).
      min_solution_tokens, max_solution_tokens: the band the solution's length (EOS included)
        falls in; the iteration count is drawn uniformly from those that land in it.
      max_prompt_tokens: prompt length cap (BOS included).
    """

    n_vars: tuple[int, ...]
    min_solution_tokens: int
    max_solution_tokens: int
    max_prompt_tokens: int


def _level(max_solution_tokens: int) -> LoopLevel:
    return LoopLevel(
        n_vars=(2, 3),
        min_solution_tokens=max_solution_tokens * 3 // 4,
        max_solution_tokens=max_solution_tokens,
        max_prompt_tokens=48,  # 3 variables, 2-digit values, `do 100:`: 46
    )


# Level l's solutions end at 64 * 2**l tokens: 128, 256, 512, 1024, 2048.
LEVELS = {level: _level(64 * 2**level) for level in range(1, 6)}


@dataclasses.dataclass(frozen=True)
class _Statement:
    """`target = source op operand`; operand is a variable name or a constant."""

    target: str
    source: str
    op: str
    operand: str | int

    @property
    def text(self) -> str:
        return f"{self.target}={self.source}{self.op}{self.operand}"


def generate(seed: int | np.random.Generator, level: int) -> Problem:
    """A problem at difficulty `level`; a pure function of the seed / Generator state."""
    check_level(level, LEVELS)
    spec = LEVELS[level]
    rng = as_generator(seed)
    return sample_until(rng, lambda r: _attempt(r, level, spec), what=f"loop L{level}")


def _attempt(rng: np.random.Generator, level: int, spec: LoopLevel) -> Problem | None:
    n_vars = int(rng.choice(spec.n_vars))
    names = sorted(str(n) for n in rng.choice(list(NAMES), n_vars, replace=False))
    init = {n: int(rng.integers(0, MODULUS)) for n in names}
    body = []
    for target in rng.permutation(names):
        source = str(rng.choice(names))
        others = [n for n in names if n != source]
        if rng.random() < 0.5:
            operand: str | int = str(rng.choice(others))
        else:
            operand = int(rng.integers(1, MODULUS))
        body.append(_Statement(str(target), source, str(rng.choice(["+", "-"])), operand))
    if not _coupled(body, names):
        return None
    query = str(rng.choice(names))

    # Run until the solution outgrows the band or the state repeats; keep the iteration counts
    # whose solution lands in the band.
    env = dict(init)
    seen = {tuple(env.values())}
    iterations: list[str] = []
    trace_chars = -1  # no ";" before the first iteration
    fits: list[tuple[int, int]] = []  # (iteration count, answer)
    while True:
        parts = []
        for s in body:
            a = env[s.source]
            b = env[s.operand] if isinstance(s.operand, str) else s.operand
            env[s.target] = (a + b if s.op == "+" else a - b) % MODULUS
            parts.append(f"{s.target}={a}{s.op}{b}={env[s.target]}")
        state = tuple(env.values())
        if state in seen:
            break
        seen.add(state)
        iterations.append(f"{len(iterations) + 1}:" + ",".join(parts))
        trace_chars += 1 + len(iterations[-1])
        answer = str(env[query])
        tokens = trace_chars + len(ANSWER_MARKER) + len(answer) + 1  # EOS
        if tokens > spec.max_solution_tokens:
            break
        if tokens >= spec.min_solution_tokens:
            fits.append((len(iterations), env[query]))
    if not fits:
        return None
    n_iter, value = fits[int(rng.integers(len(fits)))]
    statements = [f"{n}={init[n]}" for n in names] + [f"do {n_iter}:" + body[0].text]
    prompt = ";".join(statements + [s.text for s in body[1:]]) + f";?{query}"
    problem = Problem(
        task=TaskKind.LOOP,
        prompt=prompt,
        answer=str(value),
        solution=";".join(iterations[:n_iter]) + ANSWER_MARKER + str(value),
        difficulty=level,
    )
    if problem.prompt_tokens > spec.max_prompt_tokens:
        return None
    return problem


def _coupled(body: list[_Statement], names: list[str]) -> bool:
    """Whether every variable's value flows into every other's (the body's reads form one
    strongly connected graph): then the queried value depends on the whole trace, never on a
    counter that runs by itself (`a=a+3`)."""
    feeds = {n: set() for n in names}  # variable -> the variables its value is written into
    for s in body:
        for read in (s.source, s.operand):
            if isinstance(read, str):
                feeds[read].add(s.target)
    for start in names:
        reached, frontier = {start}, [start]
        while frontier:
            for n in feeds[frontier.pop()] - reached:
                reached.add(n)
                frontier.append(n)
        if reached != set(names):
            return False
    return True


def run(prompt: str) -> tuple[str, list[dict[str, int]]]:
    """(the queried variable, the variables after each iteration) of a loop prompt; an
    independent interpreter the tests check generated traces against. ValueError if malformed."""
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        raise ValueError(f"{prompt!r} is not a loop program ('a=1;...;do <n>:<body>;?<var>')")
    init, n_iter, body, query = match.groups()
    env: dict[str, int] = {}
    for stmt in init.rstrip(";").split(";"):
        name, value = _INIT.fullmatch(stmt).groups()
        env[name] = int(value)
    statements = []
    for stmt in body.rstrip(";").split(";"):
        m = _STMT.fullmatch(stmt)
        if m is None:
            raise ValueError(f"statement {stmt!r} of {prompt!r} is malformed")
        unknown = [v for v in m.groups() if v.isalpha() and v not in env]
        if unknown:
            raise ValueError(f"statement {stmt!r} of {prompt!r} names undefined {unknown[0]!r}")
        statements.append(m.groups())
    if query not in env:
        raise ValueError(f"{prompt!r} queries undefined {query!r}")
    states = []
    for _ in range(int(n_iter)):
        for target, source, op, operand in statements:
            b = env[operand] if operand.isalpha() else int(operand)
            env[target] = (env[source] + b if op == "+" else env[source] - b) % MODULUS
        states.append(dict(env))
    return query, states


def is_well_formed(answer: str) -> bool:
    """Whether `answer` is an integer in canonical form."""
    return _INT.fullmatch(answer) is not None


def check_answer(prompt: str, reference: str, answer: str) -> bool:
    """Exact match with the reference integer."""
    del prompt
    return answer == reference
