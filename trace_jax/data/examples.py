r"""Examples: a question, its reference answer, maybe a worked solution; read from JSONL / Parquet.

An `Example` is what every dataset yields and every verifier checks: a generated
`trace_jax.tasks.Problem`, or a `TextExample` read from a file. A file is one record per line
(`.jsonl`) or per row (`.parquet`); `FileLayout` names the fields:

| layout        | question_field | answer_field                | solution_field | extractor |
| ------------- | -------------- | --------------------------- | -------------- | --------- |
| GSM8K         | `question`     | `answer` (`... #### 42`)    | `answer`       | `gsm8k`   |
| MATH          | `problem`      | `solution` (`\boxed{7}`)    | `solution`     | `boxed`   |
| DAPO-Math-17k | `prompt`       | `reward_model.ground_truth` | (none)         | `none`    |

A dotted field name reaches into nested records; a question field holding chat messages
(`[{"role": "user", "content": ...}]`, as DAPO's `prompt`) gives its last user message. Answer
extractors (`ANSWER_EXTRACTORS`): `none` keeps the field's text (numbers written out), `gsm8k`
takes the text after the last `####` without thousands separators, `boxed` the content of the
last `\boxed{...}` (or `\fbox{...}`). A record without a field, or whose answer does not
extract, is an error naming the file, the line (row) and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

EXAMPLE_FILE_SUFFIXES = (".jsonl", ".parquet")


class Example(Protocol):
    """What a dataset yields. question: the prompt text (before any chat template). answer: the
    reference answer text. solution: a worked solution ending in the answer (the SFT target), or
    None. metadata: where it comes from (task and level, or file and line)."""

    @property
    def question(self) -> str: ...

    @property
    def answer(self) -> str: ...

    @property
    def solution(self) -> str | None: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextExample:
    """An example given as text (read from a file, or written by hand); see `Example`."""

    question: str
    answer: str
    solution: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _no_extraction(text: str) -> str | None:
    return text.strip() or None


def _after_hashes(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "") or None


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` / `\fbox{...}` in `text` (braces balanced), or
    None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip() or None
    return None  # unbalanced


ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "none": _no_extraction,
    "gsm8k": _after_hashes,
    "boxed": last_boxed,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileLayout:
    """Where a file's records keep an example (module docstring). solution_field "" = none."""

    question_field: str = "question"
    answer_field: str = "answer"
    solution_field: str = ""
    answer_extractor: str = "none"

    def __post_init__(self):
        for name in ("question_field", "answer_field"):
            if not getattr(self, name):
                raise ValueError(f"{name} must name a field, got ''")
        if self.answer_extractor not in ANSWER_EXTRACTORS:
            raise ValueError(
                f"answer_extractor must be one of {sorted(ANSWER_EXTRACTORS)}, "
                f"got {self.answer_extractor!r}"
            )


def check_examples_path(path: str) -> None:
    """Raises ValueError unless `path` is an existing file with a known suffix."""
    if not path.endswith(EXAMPLE_FILE_SUFFIXES):
        raise ValueError(f"must be a {' or '.join(EXAMPLE_FILE_SUFFIXES)} file, got {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"names no file: {path!r}")


def read_examples(path: str, layout: FileLayout) -> tuple[TextExample, ...]:
    """The examples of the JSONL / Parquet file `path`, in file order (cached while the file is
    unchanged). Each has metadata {"source": "<path>:<line>"} (the row for Parquet).

    Raises ValueError naming the file, line and field of the first bad record, and an empty file.
    """
    check_examples_path(path)
    path = os.path.abspath(path)
    st = os.stat(path)
    return _read_cached(path, (st.st_mtime_ns, st.st_size), layout)


@functools.lru_cache(maxsize=16)
def _read_cached(path: str, stamp: tuple[int, int], layout: FileLayout) -> tuple[TextExample, ...]:
    del stamp  # part of the cache key only: a changed file is read again
    records = _parquet_records(path) if path.endswith(".parquet") else _jsonl_records(path)
    out = tuple(_example(record, where, layout) for where, record in records)
    if not out:
        raise ValueError(f"{path} holds no examples")
    return out


def _jsonl_records(path: str):
    """(where, record) of each non-blank line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON record ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def _parquet_records(path: str):
    # pyarrow costs half a second at import: only Parquet datasets pay it.
    import pyarrow.parquet

    for n, record in enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1):
        yield f"{path}:row {n}", record


def _field(record: Mapping, name: str, where: str):
    value: Any = record
    for i, part in enumerate(name.split(".")):
        if not isinstance(value, Mapping) or part not in value:
            have = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            reached = ".".join(name.split(".")[:i]) or "the record"
            raise ValueError(f"{where}: missing field {name!r} ({reached} has {have})")
        value = value[part]
    return value


def _text(value, name: str, where: str) -> str:
    """A field's text: a string, or a number written out."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{where}: field {name!r} must be text, got {value!r}")


def _question(value, name: str, where: str) -> str:
    """A question field: text, or chat messages (the last user message's content)."""
    if isinstance(value, list | tuple):
        users = [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users or not isinstance(users[-1].get("content"), str):
            raise ValueError(f"{where}: field {name!r} holds no user message with text content")
        value = users[-1]["content"]
    text = _text(value, name, where)
    if not text.strip():
        raise ValueError(f"{where}: field {name!r} is empty")
    return text


def _example(record: Mapping, where: str, layout: FileLayout) -> TextExample:
    question = _question(_field(record, layout.question_field, where), layout.question_field, where)
    raw = _text(_field(record, layout.answer_field, where), layout.answer_field, where)
    answer = ANSWER_EXTRACTORS[layout.answer_extractor](raw)
    if answer is None:
        raise ValueError(
            f"{where}: field {layout.answer_field!r} gives no answer with the "
            f"{layout.answer_extractor!r} extractor: {raw[-80:]!r}"
        )
    solution = None
    if layout.solution_field:
        field = layout.solution_field
        solution = _text(_field(record, field, where), field, where)
    return TextExample(
        question=question, answer=answer, solution=solution, metadata={"source": where}
    )
