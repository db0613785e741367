"""The training stream and the fixed held-out test splits, named by task and level.

| split                | content                                        | stands in for  |
| -------------------- | ---------------------------------------------- | -------------- |
| `arith_countdown_l2` | 48 arithmetic + 48 countdown, level 2          | AIME 2024      |
| `arith_countdown_l3` | 48 arithmetic + 48 countdown, level 3          | AIME 2025      |
| `arith_countdown_l4` | 48 arithmetic + 48 countdown, level 4          | HMMT Feb 2025  |
| `program_l2to4`      | 32 programs each at levels 2, 3, 4             | LiveCodeBench  |
| `level1`             | 32 each of arithmetic, countdown, program, L1  | (none)         |
| `loop_l2`            | 96 loop programs, level 2 (192-256 tokens)     | AIME 2024      |
| `loop_l3`            | 96 loop programs, level 3 (384-512 tokens)     | AIME 2025      |
| `loop_l4`            | 96 loop programs, level 4 (768-1024 tokens)    | HMMT Feb 2025  |
| `loop_l5`            | 96 loop programs, level 5 (1536-2048 tokens)   | LiveCodeBench  |

The first four are the benchmark splits of the short-response regime: generated problems that
take the place of the paper's benchmarks in its tables (`SplitSpec.stands_for`, shown by
`split_legend`); real benchmark names are kept for real benchmark files. `level1` has no
counterpart in the paper: it is the in-distribution check of the CPU quickstart, whose `tiny`
model learns level 1 but not the harder splits. The `loop_*` splits take the benchmarks' place in
the long-response regime (`configs/table1_long.py`), where worked solutions run to 2048 tokens
as the paper's reasoning rollouts do; a table evaluates one regime's splits.

Splits are generated from fixed seeds, in this order, with every prompt unique across all of
them; `train_stream` skips any held-out prompt, so training never sees a test problem.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from trace_jax.tasks import registry
from trace_jax.tasks.problem import LEVELS, SHORT_TASKS, Problem, TaskKind

_TRAIN_ENTROPY = 0x7472_6169  # "trai": seeds of the training stream
_TEST_ENTROPY = 0x7465_7374  # "test": seeds of the held-out splits


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitSpec:
    """A held-out split: `parts` are (task, level, count), generated from `seed`;
    `stands_for` names the paper benchmark it takes the place of ("" for none)."""

    name: str
    stands_for: str
    parts: tuple[tuple[TaskKind, int, int], ...]
    seed: int

    @property
    def size(self) -> int:
        return sum(count for _, _, count in self.parts)


def _math(name: str, stands_for: str, level: int, seed: int) -> SplitSpec:
    parts = ((TaskKind.ARITHMETIC, level, 48), (TaskKind.COUNTDOWN, level, 48))
    return SplitSpec(name=name, stands_for=stands_for, parts=parts, seed=seed)


def _loop(stands_for: str, level: int) -> SplitSpec:
    parts = ((TaskKind.LOOP, level, 96),)
    return SplitSpec(name=f"loop_l{level}", stands_for=stands_for, parts=parts, seed=8000 + level)


# Generated in this order, every prompt unique across all of them: a split appended at the end
# leaves every split before it unchanged.
SPLITS = {
    s.name: s
    for s in (
        _math("arith_countdown_l2", "AIME 2024", level=2, seed=2024),
        _math("arith_countdown_l3", "AIME 2025", level=3, seed=2025),
        _math("arith_countdown_l4", "HMMT February 2025", level=4, seed=2502),
        SplitSpec(
            name="program_l2to4",
            stands_for="LiveCodeBench",
            parts=tuple((TaskKind.PROGRAM, level, 32) for level in (2, 3, 4)),
            seed=5000,
        ),
        SplitSpec(
            name="level1",
            stands_for="",
            parts=tuple((task, 1, 32) for task in SHORT_TASKS),
            seed=1,
        ),
        _loop("AIME 2024", level=2),
        _loop("AIME 2025", level=3),
        _loop("HMMT February 2025", level=4),
        _loop("LiveCodeBench", level=5),
    )
}
SPLIT_NAMES = tuple(SPLITS)

# The names older run logs and result files use for the benchmark splits (the benchmarks they
# stand in for); readers of such files map them with `with_current_split_names`.
RENAMED_SPLITS = types.MappingProxyType(
    {
        "aime24": "arith_countdown_l2",
        "aime25": "arith_countdown_l3",
        "hmmt25": "arith_countdown_l4",
        "livecodebench": "program_l2to4",
    }
)


def renamed_split_note(names: Iterable[str]) -> str:
    """For an error message: `; 'aime24' is now 'arith_countdown_l2'` for each old name among
    `names`, "" when there are none."""
    old = [n for n in names if n in RENAMED_SPLITS]
    return "".join(f"; {n!r} is now {RENAMED_SPLITS[n]!r}" for n in old)


def with_current_split_names(row: Mapping) -> dict:
    """A log row (an evaluation's scores by split, or a row with a `split` field) with every
    old split name (`RENAMED_SPLITS`, also in `<split>_*` keys) replaced by its current one."""

    def current(key):
        if not isinstance(key, str):
            return key
        for old, new in RENAMED_SPLITS.items():
            if key == old or key.startswith(old + "_"):
                return new + key[len(old) :]
        return key

    out = {current(k): v for k, v in row.items()}
    if "split" in out:
        out["split"] = current(out["split"])
    return out


def split_legend(names: Iterable[str]) -> str:
    """What each split stands in for, for a table's notes: "`arith_countdown_l2` (stands in
    for AIME 2024), ..., `level1` (no paper counterpart)"."""
    parts = []
    for name in names:
        stands_for = SPLITS[name].stands_for
        what = f"stands in for {stands_for}" if stands_for else "no paper counterpart"
        parts.append(f"`{name}` ({what})")
    return ", ".join(parts)


@functools.cache
def _all_splits() -> dict[str, tuple[Problem, ...]]:
    seen: set[str] = set()
    out = {}
    for spec in SPLITS.values():
        problems = []
        for part, (task, level, count) in enumerate(spec.parts):
            rng = np.random.default_rng([_TEST_ENTROPY, spec.seed, part])
            got = 0
            while got < count:
                problem = registry.generate(task, rng, level)
                if problem.prompt in seen:
                    continue
                seen.add(problem.prompt)
                problems.append(problem)
                got += 1
        out[spec.name] = tuple(problems)
    return out


def eval_split(name: str) -> list[Problem]:
    """The held-out split `name` (see `SPLIT_NAMES`): the same list on every call."""
    if name not in SPLITS:
        raise ValueError(
            f"unknown split {name!r}; expected one of {SPLIT_NAMES}{renamed_split_note([name])}"
        )
    return list(_all_splits()[name])


def eval_splits() -> dict[str, list[Problem]]:
    """Every held-out split by name."""
    return {name: list(problems) for name, problems in _all_splits().items()}


@functools.cache
def held_out_prompts() -> frozenset[str]:
    """Prompts of every held-out problem."""
    return frozenset(p.prompt for problems in _all_splits().values() for p in problems)


def train_stream(
    seed: int,
    *,
    tasks: Sequence[TaskKind | str] = SHORT_TASKS,
    levels: Sequence[int] = LEVELS,
    weights: Sequence[float] | None = None,
) -> Iterator[Problem]:
    """An endless, deterministic stream of training problems, none of them held out.

    Each problem picks a task from `tasks` (the short-response tasks unless given; with
    probabilities `weights`, uniform by default) and a level uniformly from `levels`.
    """
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    tasks = tuple(TaskKind(t) for t in tasks)
    levels = tuple(levels)
    if not tasks or not levels:
        raise ValueError(f"tasks and levels must be non-empty, got {tasks!r}, {levels!r}")
    for task in tasks:
        for level in levels:
            registry.level_spec(task, level)  # raises on an unknown level
    if weights is None:
        probs = np.full(len(tasks), 1.0 / len(tasks))
    else:
        probs = np.asarray(weights, dtype=np.float64)
        if probs.shape != (len(tasks),) or (probs < 0).any() or probs.sum() <= 0:
            raise ValueError(
                f"weights must be {len(tasks)} non-negative numbers with a positive sum, "
                f"got {weights!r}"
            )
        probs = probs / probs.sum()
    return _stream(seed, tasks, levels, probs)


def _stream(
    seed: int, tasks: tuple[TaskKind, ...], levels: tuple[int, ...], probs: np.ndarray
) -> Iterator[Problem]:
    held_out = held_out_prompts()
    rng = np.random.default_rng([_TRAIN_ENTROPY, seed])
    while True:
        task = tasks[int(rng.choice(len(tasks), p=probs))]
        level = levels[int(rng.integers(len(levels)))]
        problem = registry.generate(task, rng, level)
        if problem.prompt not in held_out:
            yield problem


def split_stats(problems: Sequence[Problem]) -> dict[str, float]:
    """Size, mean difficulty, mean / max prompt tokens (BOS included) and min / mean / max
    solution tokens (EOS included) of a list of problems."""
    prompt = np.asarray([p.prompt_tokens for p in problems])
    solution = np.asarray([p.solution_tokens for p in problems])
    return {
        "size": len(problems),
        "mean_difficulty": float(np.mean([p.difficulty for p in problems])),
        "mean_prompt_tokens": float(prompt.mean()),
        "max_prompt_tokens": int(prompt.max()),
        "min_solution_tokens": int(solution.min()),
        "mean_solution_tokens": float(solution.mean()),
        "max_solution_tokens": int(solution.max()),
    }
