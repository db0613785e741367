"""The pipeline's tokenizer interface, and the tokenizers that implement it by kind.

Every place the pipeline touches tokens goes through a `Tokenizer`: rollout prompts
(`prompt_ids`, the chat template where there is one), SFT rows (`encode` + `eos_id`), the
sampler's stop tokens (`stop_ids`) and filler (`pad_id`), and the text a verifier scores
(`response_text`).

| kind     | tokenizer                                                         |
| -------- | ----------------------------------------------------------------- |
| `"char"` | `trace_jax.tasks.TOKENIZER`: the 52 ids of the generated tasks     |
| `"hf"`   | `HFTokenizer`: a Hugging Face tokenizer directory                  |

Axis legend: T token slots.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from trace_jax.data.hf_tokenizer import CONFIG_FILE, TOKENIZER_FILE, HFTokenizer
from trace_jax.tasks import TOKENIZER as CHAR_TOKENIZER

TOKENIZER_KINDS = ("char", "hf")


class Tokenizer(Protocol):
    """What the pipeline asks of a tokenizer.

    vocab_size: every id is in [0, vocab_size) (the model's embedding may be larger).
    bos_id: the id starting a prompt without a chat template, or None.
    eos_id: the id ending an SFT target. pad_id: the filler after a row's end.
    stop_ids: ids that end a sampled response (EOS first).
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> np.ndarray:
        """int32 [T] ids of `text`, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids`, special tokens dropped."""
        ...

    def prompt_ids(self, question: str) -> np.ndarray:
        """int32 [T]: what the model sees before it answers `question`."""
        ...

    def response_text(self, ids: Sequence[int] | np.ndarray) -> str | None:
        """The text of response ids up to the first stop id; None when the response never
        stopped or holds ids that are no text. Never raises on model output."""
        ...


def load_tokenizer(kind: str, directory: str = "") -> Tokenizer:
    """The tokenizer of `kind` (`TOKENIZER_KINDS`); "hf" reads `directory` (cached per
    directory while its files are unchanged)."""
    if kind == "char":
        return CHAR_TOKENIZER
    if kind == "hf":
        return HFTokenizer.load(directory)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {TOKENIZER_KINDS}")


def check_tokenizer_dir(directory: str) -> None:
    """Raises ValueError unless `directory` holds an "hf" tokenizer's files."""
    missing = [
        name
        for name in (TOKENIZER_FILE, CONFIG_FILE)
        if not os.path.isfile(os.path.join(directory, name))
    ]
    if not directory or missing:
        raise ValueError(
            f"must be a directory holding {TOKENIZER_FILE} and {CONFIG_FILE}, got "
            f"{directory!r} (missing {missing})"
        )


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Raises ValueError unless every id of `tokenizer` fits a model of `vocab_size` ids."""
    if tokenizer.vocab_size > vocab_size:
        where = getattr(tokenizer, "directory", "the character tokenizer")
        raise ValueError(
            f"the tokenizer ({where}) has {tokenizer.vocab_size} ids but the model's vocabulary "
            f"holds {vocab_size}: use a model whose vocab_size is >= {tokenizer.vocab_size}"
        )
