"""A Hugging Face tokenizer directory as the pipeline's tokenizer, without transformers.

  tokenizer = HFTokenizer.load("/models/Qwen3-30B-A3B")
  ids = tokenizer.prompt_ids("What is 6 * 7?")   # the chat template's user turn + the
                                                # assistant header, as int32 [T]

Read from the directory:
  * `tokenizer.json`: the tokenizer itself (the `tokenizers` library);
  * `tokenizer_config.json`: the special tokens (`eos_token`, `pad_token`, `bos_token`, ...; a
    string or an `{"content": ...}` record) and the `chat_template`, unless
    `chat_template.jinja` holds the template (transformers 5 writes it there);
  * `generation_config.json`, when present: its `eos_token_id` (an id or a list) joins the stop
    ids (Qwen3 stops at `<|im_end|>` and `<|endoftext|>`).

The chat template renders as transformers' `apply_chat_template(messages,
add_generation_prompt=True)`: a sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks`,
loop controls, a `tojson` that keeps non-ASCII text, `raise_exception` and `strftime_now`, given
`messages=[{"role": "user", "content": question}]` and the named special tokens; the text is then
encoded without adding special tokens (the template writes them). Without a template a prompt is
`BOS question` (just `question` when there is no BOS). The pad id is `pad_token`'s, else EOS's.
Axis legend: T token slots.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np
import tokenizers

from trace_jax.tasks.tokenizer import response_body

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_FILE = "generation_config.json"
# The named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class HFTokenizer:
    """A tokenizer directory (module docstring); `load` caches it per directory.

    Attributes: directory; vocab_size (1 + the largest id, added tokens included); bos_id (None
    without a BOS token), eos_id, pad_id, stop_ids (EOS first); special_tokens (name -> token
    text, the ones the config sets); chat_template (the template text, or None).
    """

    def __init__(self, directory: str):
        self.directory = directory
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in the tokenizer directory {directory}")
        self._tokenizer = tokenizers.Tokenizer.from_file(path)
        config = _read_json(os.path.join(directory, CONFIG_FILE), required=True)
        self.special_tokens = {
            name: _token_text(config[name], name, directory)
            for name in SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        if "eos_token" not in self.special_tokens:
            raise ValueError(f"{directory}/{CONFIG_FILE} sets no eos_token: responses cannot end")
        ids = {name: self._token_id(name) for name in self.special_tokens}
        self.eos_id = ids["eos_token"]
        self.bos_id = ids.get("bos_token")
        self.pad_id = ids.get("pad_token", self.eos_id)
        generation = _read_json(os.path.join(directory, GENERATION_FILE), required=False)
        extra = generation.get("eos_token_id")
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in extra)]))
        self.vocab_size = 1 + max(self._tokenizer.get_vocab(with_added_tokens=True).values())
        self.chat_template = _chat_template(directory, config)
        self._template = None if self.chat_template is None else _compile(self.chat_template)

    @classmethod
    def load(cls, directory: str) -> HFTokenizer:
        """The tokenizer of `directory`, read once while its files stay unchanged."""
        if not directory:
            raise ValueError("an hf tokenizer needs its directory (tasks.tokenizer_dir)")
        directory = os.path.abspath(directory)
        stamp = tuple(
            _stamp(os.path.join(directory, name))
            for name in (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE, GENERATION_FILE)
        )
        return _load_cached(directory, stamp)

    def encode(self, text: str) -> np.ndarray:
        """int32 [T] ids of `text`; special-token text in it (`<|im_end|>`) becomes its id, no
        other special token is added."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids`, special tokens dropped."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def render_prompt(self, question: str) -> str:
        """The prompt text of `question`: the chat template's rendering of one user turn plus
        the assistant header, or `question` itself without a template."""
        if self._template is None:
            return question
        return self._template.render(
            messages=[{"role": "user", "content": question}],
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **self.special_tokens,
        )

    def prompt_ids(self, question: str) -> np.ndarray:
        """int32 [T]: the encoded `render_prompt(question)`, after BOS when there is no
        template."""
        ids = self.encode(self.render_prompt(question))
        if self._template is None and self.bos_id is not None:
            ids = np.concatenate([np.asarray([self.bos_id], np.int32), ids])
        return ids

    def response_text(self, ids: Sequence[int] | np.ndarray) -> str | None:
        """The decoded response up to its first stop id; None when it holds none (cut off),
        holds an id outside [0, vocab_size) before it, or `ids` is not a 1-D integer sequence."""
        body = response_body(ids, self.stop_ids)
        if body is None:
            return None
        if ((body < 0) | (body >= self.vocab_size)).any():
            return None  # the model's vocabulary may be larger than the tokenizer's
        return self.decode(body)

    def _token_id(self, name: str) -> int:
        text = self.special_tokens[name]
        tid = self._tokenizer.token_to_id(text)
        if tid is None:
            raise ValueError(
                f"{self.directory}/{CONFIG_FILE} names {name} {text!r}, which "
                f"{TOKENIZER_FILE} does not hold"
            )
        return tid

    def __repr__(self) -> str:
        return f"HFTokenizer({self.directory!r}, vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=8)
def _load_cached(directory: str, stamp: tuple) -> HFTokenizer:
    del stamp  # part of the cache key only: a changed file is read again
    return HFTokenizer(directory)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def _read_json(path: str, *, required: bool) -> dict:
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"no {os.path.basename(path)} beside {TOKENIZER_FILE}: {path}")
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None


def _token_text(value, name: str, directory: str) -> str:
    """A special token's text: a string, or the `content` of an AddedToken record."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, str):
        return value
    raise ValueError(f"{directory}/{CONFIG_FILE}: {name} must be a string, got {value!r}")


def _chat_template(directory: str, config: dict) -> str | None:
    """`chat_template.jinja`, else the config's `chat_template` (a string, or named templates
    of which "default" is the one), else None."""
    path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ValueError(
                f"{directory}/{CONFIG_FILE}: chat_template names {sorted(named)}, none 'default'"
            )
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory}/{CONFIG_FILE}: chat_template must be text")
    return template


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
    rendered as its body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile(template: str) -> jinja2.Template:
    """The template in transformers' environment (module docstring)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
