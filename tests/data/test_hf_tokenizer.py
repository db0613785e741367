"""A Hugging Face tokenizer directory: round trips, special ids, the chat template, padded batches
and response text, against the `tokenizers` library itself (and transformers, where installed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers

from tests.data import bpe
from trace_jax import data
from trace_jax.data import HFTokenizer

QUESTION = "what is 12 plus 5?"
RENDERED = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return bpe.write_tokenizer_dir(tmp_path_factory.mktemp("bpe"), generation_eos=[2, 0])


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HFTokenizer.load(tok_dir)


@pytest.fixture(scope="module")
def raw(tok_dir):
    """The same tokenizer through the `tokenizers` library alone: the reference."""
    return tokenizers.Tokenizer.from_file(f"{tok_dir}/tokenizer.json")


def test_round_trips(tok, raw):
    for text in (QUESTION, "", "the answer is \\boxed{42}.", "naïve ünïcode ≠ ascii\n\ttabs"):
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert ids.tolist() == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text  # byte-level BPE: every string round trips


def test_special_ids(tok, raw):
    im_end, eot = raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (im_end, eot, None)
    # EOS first, then generation_config.json's eos ids, each once.
    assert tok.stop_ids == (im_end, eot) == (2, 0)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == 320
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    # Special-token text becomes its id; decoding drops it.
    assert tok.encode("<|im_end|>").tolist() == [im_end]
    assert tok.decode([raw.token_to_id("<|im_start|>"), *tok.encode("hi"), im_end]) == "hi"


def test_chat_template_renders_as_transformers_does(tok, raw, tmp_path):
    assert tok.render_prompt(QUESTION) == RENDERED
    ids = tok.prompt_ids(QUESTION)
    assert ids.tolist() == raw.encode(RENDERED, add_special_tokens=False).ids
    assert ids[0] == raw.token_to_id("<|im_start|>")
    # The older layout (the template inside tokenizer_config.json, special tokens as AddedToken
    # records) gives the same prompt.
    older = bpe.write_tokenizer_dir(
        tmp_path / "older",
        template_in_config=True,
        config={"eos_token": {"content": "<|im_end|>", "special": True}},
    )
    assert HFTokenizer.load(older).prompt_ids(QUESTION).tolist() == ids.tolist()


def test_template_features_transformers_templates_use(tmp_path):
    template = (
        "{%- for m in messages %}{% if m['role'] == 'user' %}"
        "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
        "{% else %}{{ raise_exception('only user turns') }}{% endif %}"
        "{%- endfor %}{{ eos_token }}"
    )
    tok = HFTokenizer.load(bpe.write_tokenizer_dir(tmp_path, template=template))
    assert tok.render_prompt("1 ≠ 2") == '"1 ≠ 2"<|im_end|>'  # tojson keeps non-ASCII text


def test_without_a_template_a_prompt_is_bos_then_question(tmp_path, raw):
    plain = HFTokenizer.load(bpe.write_tokenizer_dir(tmp_path / "plain", template=None))
    assert plain.chat_template is None
    assert plain.prompt_ids(QUESTION).tolist() == raw.encode(QUESTION).ids
    with_bos = HFTokenizer.load(
        bpe.write_tokenizer_dir(
            tmp_path / "bos", template=None, config={"bos_token": "<|im_start|>"}
        )
    )
    assert with_bos.bos_id == raw.token_to_id("<|im_start|>")
    assert with_bos.prompt_ids(QUESTION).tolist() == [with_bos.bos_id, *raw.encode(QUESTION).ids]


def test_padded_prompt_batch(tok):
    examples = [data.TextExample(question=q, answer="1") for q in (QUESTION, "hi", "what is 7?")]
    prompts, lengths = data.encode_prompts(examples, tokenizer=tok, pad_to=40)
    assert prompts.shape == (3, 40) and prompts.dtype == np.int32 and lengths.dtype == np.int32
    for row, n, e in zip(prompts, lengths, examples, strict=True):
        np.testing.assert_array_equal(row[:n], tok.prompt_ids(e.question))
        assert (row[n:] == tok.pad_id).all()
    with pytest.raises(ValueError, match=r"pad_to=4 is shorter than the longest row \(row 0"):
        data.encode_prompts(examples, tokenizer=tok, pad_to=4)


def test_response_text_ends_at_a_stop_id(tok):
    body = tok.encode("the answer is \\boxed{17}.").tolist()
    assert tok.response_text([*body, tok.eos_id, 5, 6]) == "the answer is \\boxed{17}."
    assert tok.response_text([*body, 0]) == "the answer is \\boxed{17}."  # generation eos
    assert tok.response_text(body) is None  # never stopped
    assert tok.response_text([*body, tok.vocab_size, tok.eos_id]) is None  # beyond the vocab
    assert tok.response_text(np.array([[1, 2]])) is None
    assert tok.response_text(np.array([0.5, 2.0])) is None
    assert tok.response_text(np.array([tok.eos_id])) == ""


def test_load_caches_until_a_file_changes(tmp_path):
    directory = bpe.write_tokenizer_dir(tmp_path)
    first = HFTokenizer.load(directory)
    assert HFTokenizer.load(directory) is first
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "<|endoftext|>", "extra": "x" * 10}))
    again = HFTokenizer.load(directory)
    assert again is not first and again.eos_id == first.pad_id


def test_errors_name_the_file_and_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        HFTokenizer.load(str(tmp_path))
    with pytest.raises(ValueError, match=r"tasks\.tokenizer_dir"):
        HFTokenizer.load("")
    no_eos = bpe.write_tokenizer_dir(tmp_path / "a", config={"eos_token": None})
    with pytest.raises(ValueError, match="sets no eos_token"):
        HFTokenizer.load(no_eos)
    unknown = bpe.write_tokenizer_dir(tmp_path / "b", config={"pad_token": "<pad>"})
    with pytest.raises(ValueError, match=r"names pad_token '<pad>', which tokenizer.json"):
        HFTokenizer.load(unknown)
    with pytest.raises(ValueError, match="missing"):
        data.check_tokenizer_dir(str(tmp_path))
    with pytest.raises(ValueError, match=r"has 320 ids but the model's vocabulary holds 64"):
        data.check_vocab(HFTokenizer.load(bpe.write_tokenizer_dir(tmp_path / "c")), 64)
    data.check_vocab(data.load_tokenizer("char"), 64)


def test_transformers_reads_the_same_prompt(tok_dir, tok):
    """Where transformers is installed (the GPU machine), its `apply_chat_template` gives the
    same text and ids."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    messages = [{"role": "user", "content": QUESTION}]
    text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == tok.render_prompt(QUESTION)
    assert theirs(text, add_special_tokens=False)["input_ids"] == tok.prompt_ids(QUESTION).tolist()
    assert (theirs.eos_token_id, theirs.pad_token_id) == (tok.eos_id, tok.pad_id)
