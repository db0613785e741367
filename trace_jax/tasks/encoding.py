"""Problems -> token batches for SFT and rollout (right padding, the layout of `rollout`).

SFT row: `BOS prompt solution EOS`. Targets are the solution and EOS: slots
`[prompt_length, length)`; the model predicts slot t from slots `< t`.
Axis legend: B batch, T token slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from trace_jax.tasks.problem import Problem
from trace_jax.tasks.tokenizer import TOKENIZER, pad_batch


def prompt_ids(problem: Problem) -> np.ndarray:
    """int32 [T]: BOS + prompt."""
    return TOKENIZER.encode(problem.prompt, bos=True)


def solution_ids(problem: Problem) -> np.ndarray:
    """int32 [T]: worked solution + EOS (the SFT target, and a perfect response)."""
    return TOKENIZER.encode(problem.solution, eos=True)


@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """tokens int32 [B, T] (PAD after each row), lengths and prompt_lengths int32 [B]."""

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray

    @property
    def target_mask(self) -> np.ndarray:
        """bool [B, T]: slots holding solution/EOS tokens (the ones the SFT loss predicts)."""
        t = np.arange(self.tokens.shape[1])[None, :]
        return (t >= self.prompt_lengths[:, None]) & (t < self.lengths[:, None])


def encode_sft_batch(problems: Sequence[Problem], *, pad_to: int | None = None) -> SFTBatch:
    """Right-padded SFT rows of `problems` (see the module docstring)."""
    prompts = [prompt_ids(p) for p in problems]
    rows = [np.concatenate([q, solution_ids(p)]) for q, p in zip(prompts, problems, strict=True)]
    tokens, lengths = pad_batch(rows, pad_to=pad_to)
    return SFTBatch(tokens, lengths, np.asarray([len(q) for q in prompts], dtype=np.int32))


def encode_prompts(
    problems: Sequence[Problem], *, pad_to: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded rollout prompts int32 [B, T] (BOS + prompt) and their lengths int32 [B]."""
    return pad_batch([prompt_ids(p) for p in problems], pad_to=pad_to)
