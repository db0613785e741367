"""Examples -> token batches for SFT and rollout (right padding, the layout of `rollout`).

SFT row: `prompt solution EOS`, the prompt being `tokenizer.prompt_ids(question)` (`BOS question`
with the character tokenizer). Targets are the solution and EOS: slots
`[prompt_length, length)`; the model predicts slot t from slots `< t`.

An example is anything with `question` and `solution` text: a generated `Problem`, or a
`trace_jax.data.TextExample`. The tokenizer is the character tokenizer unless one is given (any
`trace_jax.data.Tokenizer`).
Axis legend: B batch, T token slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from trace_jax.tasks.tokenizer import TOKENIZER, pad_batch


def prompt_ids(example, tokenizer=TOKENIZER) -> np.ndarray:
    """int32 [T]: the example's prompt (`tokenizer.prompt_ids(example.question)`)."""
    return tokenizer.prompt_ids(example.question)


def solution_ids(example, tokenizer=TOKENIZER) -> np.ndarray:
    """int32 [T]: worked solution + EOS (the SFT target, and a perfect response).

    Raises ValueError when the example has no worked solution.
    """
    if not example.solution:
        raise ValueError(f"example {example.question[:80]!r} has no worked solution for SFT")
    return np.concatenate(
        [tokenizer.encode(example.solution), np.asarray([tokenizer.eos_id], np.int32)]
    )


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


def encode_sft_batch(
    examples: Sequence, *, pad_to: int | None = None, tokenizer=TOKENIZER
) -> SFTBatch:
    """Right-padded SFT rows of `examples` (see the module docstring)."""
    prompts = [prompt_ids(e, tokenizer) for e in examples]
    rows = [
        np.concatenate([q, solution_ids(e, tokenizer)])
        for q, e in zip(prompts, examples, strict=True)
    ]
    tokens, lengths = pad_batch(rows, pad_to=pad_to, pad_id=tokenizer.pad_id)
    return SFTBatch(tokens, lengths, np.asarray([len(q) for q in prompts], dtype=np.int32))


def encode_prompts(
    examples: Sequence, *, pad_to: int | None = None, tokenizer=TOKENIZER
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded rollout prompts int32 [B, T] (`prompt_ids` of each) and their lengths
    int32 [B]."""
    return pad_batch(
        [prompt_ids(e, tokenizer) for e in examples], pad_to=pad_to, pad_id=tokenizer.pad_id
    )
