"""Prompt datasets: the generated tasks and example files, behind one interface, and the held-out
evaluation sets.

| kind          | dataset            | examples                                                 |
| ------------- | ------------------ | -------------------------------------------------------- |
| `"synthetic"` | `SyntheticDataset` | `trace_jax.tasks.train_stream` of some kinds and levels  |
| `"file"`      | `FileDataset`      | a JSONL / Parquet file (`trace_jax.data.examples`)       |

Resumable by construction: the examples of RL step s are a pure function of (seed, s, n), so a
resumed run samples exactly what an uninterrupted one would. A file dataset is read as a sequence
of epochs, each a permutation of the file drawn from (seed, epoch): step s takes positions
[s n, (s + 1) n) of that sequence, wrapping into the next epoch's fresh permutation. The
synthetic dataset keeps the generated tasks' own seeding (a stream per step).
Axis legend: T token slots.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from trace_jax import tasks
from trace_jax.data.examples import Example, FileLayout, TextExample, read_examples
from trace_jax.data.tokenizer import Tokenizer

DATASET_KINDS = ("synthetic", "file")
_SHUFFLE_ENTROPY = 0x6669_6C65  # "file": seeds of a file dataset's epoch permutations
# The seed stride between RL steps of the synthetic dataset (its stream of step s is seeded
# `seed * _STEP_STRIDE + s`).
_STEP_STRIDE = 1_000_003


class PromptDataset(Protocol):
    """A source of training examples."""

    def step_examples(self, seed: int, step: int, n: int) -> list[Example]:
        """The `n` examples of RL step `step` of a run seeded `seed` (a pure function)."""
        ...

    def stream(self, seed: int) -> Iterator[Example]:
        """Every example of a run seeded `seed`, in order, endlessly (SFT batches)."""
        ...

    def prompt_width(self, tokenizer: Tokenizer) -> int:
        """Tokens of the longest prompt the dataset gives (every RL step pads to it: one
        compiled sampler)."""
        ...

    def sft_row_length(self, tokenizer: Tokenizer) -> int:
        """Tokens of the longest SFT row (prompt + solution + EOS), for one compiled SFT step.
        Raises ValueError when the examples carry no worked solutions."""
        ...


@dataclasses.dataclass(frozen=True)
class SyntheticDataset:
    """The generated tasks `kinds` at difficulty `levels` (`trace_jax.tasks`); never a held-out
    problem."""

    kinds: tuple[str, ...]
    levels: tuple[int, ...]

    def step_examples(self, seed: int, step: int, n: int) -> list[tasks.Problem]:
        stream = tasks.train_stream(
            seed * _STEP_STRIDE + step, tasks=self.kinds, levels=self.levels
        )
        return list(itertools.islice(stream, n))

    def stream(self, seed: int) -> Iterator[tasks.Problem]:
        return tasks.train_stream(seed, tasks=self.kinds, levels=self.levels)

    def prompt_width(self, tokenizer: Tokenizer) -> int:
        """The tasks' prompt caps (characters) after the tokenizer's prompt of an empty
        question: exact for the character tokenizer (one id per character after BOS), a bound
        for tokenizers whose tokens hold one character or more."""
        caps = [tasks.level_spec(t, lv).max_prompt_tokens for t in self.kinds for lv in self.levels]
        return len(tokenizer.prompt_ids("")) + max(caps)

    def sft_row_length(self, tokenizer: Tokenizer) -> int:
        """As `prompt_width`, for prompt + solution + EOS; taken over the short-response tasks
        and `kinds`, so that every mix of the short tasks shares the shape (and a long task
        widens only its own runs' rows)."""
        caps = [
            tasks.level_spec(t, lv).max_prompt_tokens + tasks.level_spec(t, lv).max_solution_tokens
            for t in {*tasks.SHORT_TASKS, *self.kinds}
            for lv in self.levels
        ]
        return len(tokenizer.prompt_ids("")) + max(caps) + 1


@dataclasses.dataclass(frozen=True)
class FileDataset:
    """The examples of a JSONL / Parquet file (`read_examples`), shuffled per epoch (module
    docstring)."""

    path: str
    layout: FileLayout

    @property
    def examples(self) -> tuple[TextExample, ...]:
        """The file's examples in file order (read once while the file is unchanged)."""
        return read_examples(self.path, self.layout)

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """int64 [N]: the file positions in epoch `epoch`'s order."""
        return _permutation(len(self.examples), seed, epoch)

    def step_examples(self, seed: int, step: int, n: int) -> list[TextExample]:
        return self._positions(seed, range(step * n, (step + 1) * n))

    def stream(self, seed: int) -> Iterator[TextExample]:
        for start in itertools.count(0, 256):
            yield from self._positions(seed, range(start, start + 256))

    def prompt_width(self, tokenizer: Tokenizer) -> int:
        return _longest(self, tokenizer, solution=False)

    def sft_row_length(self, tokenizer: Tokenizer) -> int:
        if not self.layout.solution_field:
            raise ValueError(
                f"{self.path}: SFT needs worked solutions, and the layout names no solution "
                "field (tasks.solution_field)"
            )
        return _longest(self, tokenizer, solution=True)

    def _positions(self, seed: int, positions: range) -> list[TextExample]:
        examples = self.examples
        out = []
        for i in positions:
            epoch, at = divmod(i, len(examples))
            out.append(examples[int(self.order(seed, epoch)[at])])
        return out


def make_dataset(
    kind: str,
    *,
    kinds: Sequence[str] = (),
    levels: Sequence[int] = (),
    path: str = "",
    layout: FileLayout | None = None,
) -> PromptDataset:
    """The dataset of `kind` (`DATASET_KINDS`): "synthetic" of `kinds` at `levels`, or "file"
    reading `path` with `layout`."""
    if kind == "synthetic":
        return SyntheticDataset(tuple(kinds), tuple(levels))
    if kind == "file":
        return FileDataset(path, layout or FileLayout())
    raise ValueError(f"unknown dataset kind {kind!r}; expected one of {DATASET_KINDS}")


@functools.lru_cache(maxsize=8)
def _permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([_SHUFFLE_ENTROPY, seed, epoch]).permutation(size)


def _longest(dataset: FileDataset, tokenizer: Tokenizer, *, solution: bool) -> int:
    """Tokens of the longest prompt (with `solution`: prompt + solution + EOS) of `dataset`."""
    longest = 0
    for e in dataset.examples:
        n = len(tokenizer.prompt_ids(e.question))
        if solution:
            n += len(tokenizer.encode(e.solution)) + 1
        longest = max(longest, n)
    return longest


def held_out_sets(
    splits: Sequence[str], files: Sequence[str], layout: FileLayout, size: int
) -> dict[str, list[Example]]:
    """Name -> the first `size` examples of each held-out set: the generated splits `splits`
    (`trace_jax.tasks.eval_split`), then the example files `files`, each named by its file name
    without the suffix (read with `layout`, in file order).

    Raises ValueError when two sets share a name.
    """
    out: dict[str, list[Example]] = {name: tasks.eval_split(name)[:size] for name in splits}
    for path in files:
        name = held_out_name(path)
        if name in out:
            raise ValueError(f"two held-out sets are named {name!r} (eval.splits / eval.files)")
        out[name] = list(read_examples(path, layout)[:size])
    return out


def held_out_name(path: str) -> str:
    """The name of the held-out set of the file `path`: its file name without the suffix."""
    return os.path.splitext(os.path.basename(path))[0]
