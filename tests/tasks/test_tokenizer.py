"""Tokenizer: vocabulary, round trips, batching and errors."""

from __future__ import annotations

import numpy as np
import pytest

from trace_jax.models.config import ModelConfig
from trace_jax.tasks import tokenizer as tk
from trace_jax.tasks.tokenizer import TOKENIZER


def test_vocabulary_fits_tiny_model():
    assert tk.VOCAB_SIZE == len(tk.VOCAB) == 52
    assert tk.VOCAB_SIZE <= ModelConfig.tiny().vocab_size == 64
    assert len(set(tk.VOCAB)) == tk.VOCAB_SIZE
    assert (tk.PAD_ID, tk.BOS_ID, tk.EOS_ID) == (0, 1, 2)
    assert tk.VOCAB[tk.ANSWER_ID] == tk.ANSWER_MARKER == ">"
    for ch in "0123456789+-*/()=,;?: abcxyz":
        assert ch in tk.CHARS


def test_round_trip_every_character():
    ids = TOKENIZER.encode(tk.CHARS)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, np.arange(3, tk.VOCAB_SIZE))
    assert TOKENIZER.decode(ids) == tk.CHARS
    text = "3+4*2-5=3+8-5=11-5=6>6"
    assert TOKENIZER.decode(TOKENIZER.encode(text)) == text


def test_special_tokens():
    ids = TOKENIZER.encode("1+2", bos=True, eos=True)
    assert ids[0] == tk.BOS_ID and ids[-1] == tk.EOS_ID and len(ids) == 5
    assert TOKENIZER.decode(ids) == "1+2"
    assert TOKENIZER.decode(ids, skip_special=False) == "<bos>1+2<eos>"
    with_tail = np.concatenate([ids, TOKENIZER.encode("99")])
    assert TOKENIZER.decode(with_tail, stop_at_eos=True) == "1+2"


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=r"'X' at position 2"):
        TOKENIZER.encode("1+X")
    with pytest.raises(ValueError, match=r"'<' at position 0"):
        TOKENIZER.encode("<eos>")  # special tokens never come from text
    with pytest.raises(ValueError, match="outside"):
        TOKENIZER.decode([5, 64])
    with pytest.raises(ValueError, match="outside"):
        TOKENIZER.decode([-1])
    with pytest.raises(TypeError):
        TOKENIZER.encode(123)


def test_batch_right_padding():
    tokens, lengths = TOKENIZER.encode_batch(["1+2=", "", "a=3;?a"], bos=True, eos=True)
    assert tokens.dtype == np.int32 and lengths.dtype == np.int32
    assert tokens.shape == (3, 8)
    np.testing.assert_array_equal(lengths, [6, 2, 8])
    assert (tokens[0, 6:] == tk.PAD_ID).all() and (tokens[1, 2:] == tk.PAD_ID).all()
    assert TOKENIZER.decode_batch(tokens, lengths) == ["1+2=", "", "a=3;?a"]
    padded, _ = TOKENIZER.encode_batch(["12"], pad_to=5)
    assert padded.shape == (1, 5)
    with pytest.raises(ValueError, match="pad_to=1"):
        TOKENIZER.encode_batch(["12"], pad_to=1)


def test_the_pipeline_interface():
    """What `trace_jax.data.Tokenizer` asks: stop and pad ids, prompts as BOS + question, and a
    response's text up to EOS (None when cut off or when a non-text id precedes EOS)."""
    assert (TOKENIZER.stop_ids, TOKENIZER.pad_id, TOKENIZER.bos_id) == ((2,), 0, 1)
    assert TOKENIZER.prompt_ids("1+2=").tolist() == [tk.BOS_ID, 5, 14, 6, 20]
    body = TOKENIZER.encode("1+2=3>3").tolist()
    assert TOKENIZER.response_text([*body, tk.EOS_ID, 9, tk.PAD_ID]) == "1+2=3>3"
    assert TOKENIZER.response_text(body) is None
    for bad in ([tk.PAD_ID], [tk.BOS_ID], [tk.VOCAB_SIZE], [-1]):
        assert TOKENIZER.response_text([*body, *bad, tk.EOS_ID]) is None
    assert TOKENIZER.response_text(np.array([[5, tk.EOS_ID]])) is None
    assert TOKENIZER.response_text(["a", "b"]) is None


def test_pad_batch_takes_the_filler():
    tokens, lengths = tk.pad_batch([np.array([5, 6]), np.array([7])], pad_id=9, pad_to=3)
    np.testing.assert_array_equal(tokens, [[5, 6, 9], [7, 9, 9]])
    np.testing.assert_array_equal(lengths, [2, 1])
