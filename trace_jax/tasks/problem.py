"""The problem record shared by every task, and the seed convention of the generators."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from trace_jax.tasks.tokenizer import ANSWER_MARKER, TOKENIZER

LEVELS = (1, 2, 3, 4, 5)  # difficulty levels of every task, easiest first


class TaskKind(enum.StrEnum):
    """The generated tasks; members are `str`."""

    ARITHMETIC = "arithmetic"
    COUNTDOWN = "countdown"
    PROGRAM = "program"
    LOOP = "loop"


# Worked solutions of at most about 100 tokens: the short-response regime, and the default mix.
SHORT_TASKS = (TaskKind.ARITHMETIC, TaskKind.COUNTDOWN, TaskKind.PROGRAM)
# Worked solutions of 96-2048 tokens (by level): the long-response regime.
LONG_TASKS = (TaskKind.LOOP,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """One generated problem.

    Attributes:
      task: which generator made it (and which verifier checks it).
      prompt: the question text (the model sees BOS + prompt).
      answer: the reference answer text (for countdown, one valid expression; any expression
        that verifies is accepted).
      solution: the worked solution the SFT target is made of: reasoning, then
        `ANSWER_MARKER + answer`; the tokens add EOS after it.
      difficulty: level in `LEVELS`.

    A problem is an example of the pipeline's datasets (`trace_jax.data.Example`): `question` is
    its prompt, `metadata` its task and difficulty.
    """

    task: TaskKind
    prompt: str
    answer: str
    solution: str
    difficulty: int

    def __post_init__(self):
        object.__setattr__(self, "task", TaskKind(self.task))
        if self.difficulty not in LEVELS:
            raise ValueError(f"difficulty must be one of {LEVELS}, got {self.difficulty!r}")
        if not self.answer or ANSWER_MARKER in self.answer:
            raise ValueError(f"answer must be non-empty without {ANSWER_MARKER!r}: {self.answer!r}")
        if not self.solution.endswith(ANSWER_MARKER + self.answer):
            raise ValueError(
                f"solution {self.solution!r} must end with {ANSWER_MARKER + self.answer!r}"
            )
        if self.solution.count(ANSWER_MARKER) != 1 or ANSWER_MARKER in self.prompt:
            raise ValueError(
                f"the answer marker {ANSWER_MARKER!r} must appear once in the solution and "
                f"never in the prompt: {self.prompt!r} / {self.solution!r}"
            )
        for name in ("prompt", "solution"):
            if not TOKENIZER.in_vocab(getattr(self, name)):
                TOKENIZER.encode(getattr(self, name))  # raises, naming the character

    @property
    def question(self) -> str:
        """The prompt (the name every dataset's examples share)."""
        return self.prompt

    @property
    def metadata(self) -> dict[str, str | int]:
        """{"task": the task's name, "difficulty": its level}."""
        return {"task": self.task.value, "difficulty": self.difficulty}

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens, BOS included."""
        return len(self.prompt) + 1

    @property
    def solution_tokens(self) -> int:
        """Worked-solution length in tokens, EOS included."""
        return len(self.solution) + 1


def as_generator(seed: int | np.random.Generator) -> np.random.Generator:
    """`seed` itself when it is a Generator, else `np.random.default_rng(seed)`."""
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def check_level(level: int, table: dict) -> None:
    """Raises ValueError unless `level` is a key of a task's level table."""
    if isinstance(level, bool) or level not in table:
        raise ValueError(f"difficulty level must be one of {sorted(table)}, got {level!r}")


def sample_until(rng: np.random.Generator, attempt, *, what: str, tries: int = 10_000):
    """Calls `attempt(rng)` until it returns a value other than None (rejection sampling)."""
    for _ in range(tries):
        out = attempt(rng)
        if out is not None:
            return out
    raise RuntimeError(f"could not generate {what} in {tries} attempts")
