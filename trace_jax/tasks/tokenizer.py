"""A character-level tokenizer with a fixed vocabulary of 52 ids (fits the `tiny` model's 64).

| ids    | tokens                                   |
| ------ | ---------------------------------------- |
| 0      | PAD (`<pad>`), filler after a sequence    |
| 1      | BOS (`<bos>`), starts every prompt        |
| 2      | EOS (`<eos>`), ends every response        |
| 3      | `>`, the answer marker (SEP)              |
| 4-13   | `0`-`9`                                   |
| 14-25  | `+ - * / ( ) = , ; ? :` and space         |
| 26-51  | `a`-`z`                                   |

Every printable token is one character, so `decode(encode(s)) == s` for any string over the
alphabet. Special tokens never come from text: `encode` adds BOS/EOS only when asked.
`CharTokenizer` implements the pipeline's tokenizer interface (`trace_jax.data.Tokenizer`): a
prompt is `BOS question`, a response ends at EOS.
Axis legend: B batch, T token slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ANSWER_MARKER = ">"
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARS = ANSWER_MARKER + "0123456789" + "+-*/()=,;?: " + "abcdefghijklmnopqrstuvwxyz"

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
ANSWER_ID = len(SPECIAL_TOKENS)  # the id of ANSWER_MARKER
VOCAB = SPECIAL_TOKENS + tuple(CHARS)
VOCAB_SIZE = len(VOCAB)

_CHAR_TO_ID = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHARS)}


def response_body(ids: Sequence[int] | np.ndarray, stop_ids: Sequence[int]) -> np.ndarray | None:
    """int64 [T]: response ids before the first of `stop_ids`; None when `ids` are not a 1-D
    integer sequence or hold no stop id (the response was cut off). Never raises on model
    output (every tokenizer's `response_text` starts here)."""
    try:
        ids = np.asarray(ids)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            return None
        ids = ids.astype(np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    ends = np.flatnonzero(np.isin(ids, np.asarray(stop_ids, np.int64)))
    return None if ends.size == 0 else ids[: ends[0]]


class CharTokenizer:
    """Encodes text over `CHARS` to int32 ids and back; stateless (use the `TOKENIZER` instance)."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    stop_ids = (EOS_ID,)
    answer_id = ANSWER_ID
    vocab_size = VOCAB_SIZE
    vocab = VOCAB

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """int32 [T] ids of `text`, with BOS prepended / EOS appended when asked.

        Raises ValueError naming the first character that is not in the vocabulary.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = [BOS_ID] if bos else []
        for pos, ch in enumerate(text):
            tid = _CHAR_TO_ID.get(ch)
            if tid is None:
                raise ValueError(
                    f"character {ch!r} at position {pos} of {text!r} is not in the vocabulary "
                    f"(allowed: {CHARS!r})"
                )
            ids.append(tid)
        if eos:
            ids.append(EOS_ID)
        return np.asarray(ids, dtype=np.int32)

    def decode(
        self,
        ids: Iterable[int] | np.ndarray,
        *,
        skip_special: bool = True,
        stop_at_eos: bool = False,
    ) -> str:
        """Text of `ids`; special tokens are dropped (or written as `<pad>` etc. when
        `skip_special=False`); `stop_at_eos` cuts at the first EOS.

        Raises ValueError on an id outside [0, vocab_size).
        """
        out = []
        for pos, raw in enumerate(np.asarray(ids).reshape(-1).tolist()):
            tid = int(raw)
            if tid != raw or not 0 <= tid < VOCAB_SIZE:
                raise ValueError(f"id {raw!r} at position {pos} is outside [0, {VOCAB_SIZE})")
            if tid == EOS_ID and stop_at_eos:
                break
            if tid < len(SPECIAL_TOKENS):
                if not skip_special:
                    out.append(VOCAB[tid])
            else:
                out.append(VOCAB[tid])
        return "".join(out)

    def prompt_ids(self, question: str) -> np.ndarray:
        """int32 [T]: BOS + `question` (what the model sees before it answers)."""
        return self.encode(question, bos=True)

    def response_text(self, ids: Sequence[int] | np.ndarray) -> str | None:
        """The text of response ids up to the first EOS; None when there is no EOS (cut off),
        or a non-text id (PAD, BOS, outside the vocabulary) comes before it, or `ids` are not
        a 1-D integer sequence. Never raises on model output."""
        body = response_body(ids, (EOS_ID,))
        if body is None:
            return None
        if ((body < len(SPECIAL_TOKENS)) | (body >= VOCAB_SIZE)).any():
            return None
        return self.decode(body)

    def encode_batch(
        self,
        texts: Sequence[str],
        *,
        bos: bool = False,
        eos: bool = False,
        pad_to: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded int32 ids [B, T] and int32 lengths [B].

        T is the longest row, or `pad_to` (ValueError when a row is longer).
        """
        rows = [self.encode(t, bos=bos, eos=eos) for t in texts]
        return pad_batch(rows, pad_to=pad_to, pad_id=PAD_ID)

    def decode_batch(
        self, ids: np.ndarray, lengths: np.ndarray | None = None, *, skip_special: bool = True
    ) -> list[str]:
        """Texts of rows `ids [B, T]`, each cut to `lengths[b]` when given."""
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"decode_batch expects ids of shape [B, T], got {ids.shape}")
        if lengths is None:
            lengths = np.full(ids.shape[0], ids.shape[1])
        return [
            self.decode(row[: int(n)], skip_special=skip_special)
            for row, n in zip(ids, np.asarray(lengths), strict=True)
        ]

    def in_vocab(self, text: str) -> bool:
        """Whether every character of `text` has an id."""
        return all(c in _CHAR_TO_ID for c in text)


def pad_batch(
    rows: Sequence[np.ndarray], *, pad_to: int | None = None, pad_id: int = PAD_ID
) -> tuple[np.ndarray, np.ndarray]:
    """Stacks 1-D id rows into right-padded int32 [B, T] (`pad_id` filler) and int32 lengths [B].

    T is the longest row, or `pad_to` (ValueError naming the longest row when it is longer).
    """
    lengths = np.asarray([len(r) for r in rows], dtype=np.int32)
    longest = int(lengths.max()) if len(rows) else 0
    width = longest if pad_to is None else int(pad_to)
    if width < longest:
        row = int(lengths.argmax())
        raise ValueError(
            f"pad_to={pad_to} is shorter than the longest row (row {row}: {longest} tokens)"
        )
    out = np.full((len(rows), width), pad_id, dtype=np.int32)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out, lengths


TOKENIZER = CharTokenizer()
