r"""Verifiers: a response's text against an example's reference answer, as a `Score`; rewards.

| kind          | verifier            | answer                           | correct when         |
| ------------- | ------------------- | -------------------------------- | -------------------- |
| `"synthetic"` | `SyntheticVerifier` | after the marker: `reasoning>42` | the task's checker   |
| `"math"`      | `MathVerifier`      | `\boxed{..}`, a number, LaTeX    | `math_verify.verify` |

A response's text is `tokenizer.response_text(ids)`: None when the response never stopped, and
such a response scores 0. A reward is `Score.reward(format_weight)`: 1 if correct, else
`format_weight` if well formed, else 0; pass@k (`pass_at_k`) reads rewards of any verifier.

math_verify bounds its parsing and comparison time with SIGALRM, which Python allows on the main
thread only: `MathVerifier` passes its timeout there and none elsewhere (a verifier called from a
worker thread runs unbounded rather than failing).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from trace_jax import tasks
from trace_jax.data.examples import Example
from trace_jax.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

VERIFIER_KINDS = ("synthetic", "math")


class Verifier(Protocol):
    """Checks a response's text against an example."""

    def score(self, example: Example, response: str | None) -> tasks.Score:
        """The verdict on `response` (None: the response never stopped); never raises on model
        output."""
        ...


class SyntheticVerifier:
    """The generated tasks' exact checker (`trace_jax.tasks.score`): examples must be
    `tasks.Problem`s."""

    def score(self, example: Example, response: str | None) -> tasks.Score:
        if not isinstance(example, tasks.Problem):
            raise TypeError(
                f"the synthetic verifier checks generated problems only, got {example!r}; "
                "use the math verifier (tasks.verifier='math') for examples from files"
            )
        if response is None:
            return tasks.Score(answer=None, well_formed=False, correct=False)
        return tasks.score(example, response)


class MathVerifier:
    """math_verify's answer extraction and equivalence (boxed answers, numbers, fractions,
    LaTeX). well_formed: the response holds an answer math_verify extracts; answer: its text.

    timeout_s: the bound on each parse and comparison on the main thread (module docstring).
    """

    def __init__(self, timeout_s: int = 5):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(f"timeout_s must be an int >= 1 (whole seconds), got {timeout_s!r}")
        self.timeout_s = timeout_s

    def score(self, example: Example, response: str | None) -> tasks.Score:
        if response is None:
            return tasks.Score(answer=None, well_formed=False, correct=False)
        math_verify = _math_verify()
        timeout = self._timeout()
        predicted = math_verify.parse(response, parsing_timeout=timeout)
        if not predicted:
            return tasks.Score(answer=None, well_formed=False, correct=False)
        gold = self.gold(example.answer)  # [] (logged once) scores every response wrong
        correct = bool(gold) and bool(math_verify.verify(gold, predicted, timeout_seconds=timeout))
        text = predicted[-1] if isinstance(predicted[-1], str) else str(predicted[0])
        return tasks.Score(answer=text, well_formed=True, correct=correct)

    def gold(self, answer: str) -> list:
        """The parsed reference answer: as LaTeX math (`$answer$`) unless it carries its own
        delimiters, else as plain text; [] when neither parses."""
        return _parse_gold(answer, self._timeout())

    def _timeout(self) -> int | None:
        on_main = threading.current_thread() is threading.main_thread()
        return self.timeout_s if on_main else None


def _math_verify():
    # math_verify imports sympy (a second): only runs that verify math pay it.
    import math_verify

    return math_verify


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> list:
    parse = _math_verify().parse
    delimited = "$" in answer or "\\boxed" in answer or "\\(" in answer
    gold = [] if delimited else parse(f"${answer}$", parsing_timeout=timeout)
    gold = gold or parse(answer, parsing_timeout=timeout)
    if not gold:
        log.warning("the reference answer %r does not parse: no response can match it", answer)
    return gold


def make_verifier(kind: str) -> Verifier:
    """The verifier of `kind` (`VERIFIER_KINDS`)."""
    if kind == "synthetic":
        return SyntheticVerifier()
    if kind == "math":
        return MathVerifier()
    raise ValueError(f"unknown verifier kind {kind!r}; expected one of {VERIFIER_KINDS}")


def compute_rewards(
    examples: Sequence[Example],
    responses: Sequence[np.ndarray],
    *,
    tokenizer: Tokenizer,
    verifier: Verifier,
    format_weight: float = 0.0,
) -> np.ndarray:
    """float32 [B] rewards of the response ids `responses[b]` (int [T_b]) on `examples[b]`:
    `verifier.score(example, tokenizer.response_text(ids)).reward(format_weight)`."""
    if len(examples) != len(responses):
        raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
    return np.asarray(
        [
            verifier.score(e, tokenizer.response_text(r)).reward(format_weight)
            for e, r in zip(examples, responses, strict=True)
        ],
        dtype=np.float32,
    )
