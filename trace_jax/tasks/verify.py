"""Verifiers and rewards: parse a model response, check its answer, score pass@k.

A response (what the model wrote after BOS + prompt) is `reasoning + ">" + answer + EOS`. The
answer is the text between the one answer marker and EOS. Responses are token ids (EOS required;
PAD after EOS is ignored) or decoded text (EOS assumed at its end). Nothing here raises on model
output: a malformed response (no EOS, no marker or several, empty answer, PAD/BOS or unknown ids
before EOS, extra text after the answer) scores 0.

`Score`, `responses_from_rollout` and pass@k serve every dataset kind: `trace_jax.data` scores
file datasets with the math verifier into the same record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from trace_jax.tasks import registry
from trace_jax.tasks.problem import Problem
from trace_jax.tasks.tokenizer import ANSWER_MARKER, TOKENIZER

Response = str | Sequence[int] | np.ndarray


@dataclasses.dataclass(frozen=True)
class Score:
    """Verdict on one response.

    answer: the extracted answer text (None when the response has no parseable answer slot).
    well_formed: the response has the format and the answer has the task's syntax.
    correct: the answer solves the problem (implies well_formed).
    """

    answer: str | None
    well_formed: bool
    correct: bool

    def reward(self, format_weight: float = 0.0) -> float:
        """1 if correct, else `format_weight` if well formed, else 0.

        This is `(1 - w) * correct + w * well_formed` (correct implies well formed); with the
        default `format_weight=0` it is the exact-match reward 1/0.
        """
        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {format_weight!r}")
        if self.correct:
            return 1.0
        return format_weight * float(self.well_formed)


def response_text(response: Response) -> str | None:
    """The text of a response up to EOS; None for ids without EOS or with non-text ids before it
    (`CharTokenizer.response_text`)."""
    if isinstance(response, str):
        return response
    return TOKENIZER.response_text(response)


def extract_answer(response: Response) -> str | None:
    """The text after the single answer marker, up to EOS; None when there is none."""
    text = response_text(response)
    if text is None or text.count(ANSWER_MARKER) != 1:
        return None
    answer = text.split(ANSWER_MARKER)[1]
    return answer or None


def score(problem: Problem, response: Response) -> Score:
    """Parses and checks `response` against `problem`."""
    answer = extract_answer(response)
    if answer is None:
        return Score(answer=None, well_formed=False, correct=False)
    well_formed = registry.is_well_formed(problem.task, answer)
    correct = well_formed and registry.check_answer(problem, answer)
    return Score(answer=answer, well_formed=well_formed, correct=correct)


def reward(problem: Problem, response: Response, *, format_weight: float = 0.0) -> float:
    """`score(problem, response).reward(format_weight)`: 1 if correct, else `format_weight` if
    well formed, else 0."""
    return score(problem, response).reward(format_weight)


def batch_rewards(
    problems: Sequence[Problem], responses: Sequence[Response], *, format_weight: float = 0.0
) -> np.ndarray:
    """float32 [B] rewards of `responses[b]` on `problems[b]`."""
    if len(problems) != len(responses):
        raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
    return np.asarray(
        [
            reward(p, r, format_weight=format_weight)
            for p, r in zip(problems, responses, strict=True)
        ],
        dtype=np.float32,
    )


def responses_from_rollout(
    tokens: np.ndarray, prompt_lengths: np.ndarray, lengths: np.ndarray
) -> list[np.ndarray]:
    """Response ids of each row of a rollout: `tokens[b, prompt_lengths[b]:lengths[b]]`.

    tokens: int [B, S]; prompt_lengths, lengths: int [B] (jax arrays are fine).
    """
    tokens = np.asarray(tokens)
    prompt_lengths, lengths = np.asarray(prompt_lengths), np.asarray(lengths)
    rows = (tokens.shape[0],) if tokens.ndim == 2 else None
    if rows is None or prompt_lengths.shape != rows or lengths.shape != rows:
        raise ValueError(
            f"expected tokens [B, S] and lengths [B], got {tokens.shape}, "
            f"{prompt_lengths.shape}, {lengths.shape}"
        )
    return [
        tokens[b, int(p) : int(n)]
        for b, (p, n) in enumerate(zip(prompt_lengths, lengths, strict=True))
    ]


def pass_at_1(rewards) -> float:
    """Mean over problems of the mean reward over each problem's k samples; rewards [P, k].

    Use rewards with `format_weight=0` (exact match) to report pass@1.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty [problems, samples] array, got {r.shape}")
    return float(r.mean(axis=1).mean())


def pass_at_k(correct, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021), averaged over problems.

    correct: [P, n], bool or rewards; a sample counts as correct when its value is >= 1 (so a
    format-only reward does not).
    """
    c = np.asarray(correct)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"correct must be a non-empty [problems, samples] array, got {c.shape}")
    n = c.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for {n} samples per problem, got {k}")
    hits = (c.astype(np.float64) >= 1.0).sum(axis=1)
    per = [1.0 - math.comb(n - int(h), k) / math.comb(n, k) for h in hits]
    return float(np.mean(per))
