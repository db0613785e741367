"""Small BPE tokenizers trained here with `tokenizers` (no download), written as Hugging Face
tokenizer directories the way transformers 5 writes them."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Qwen's chat format, cut to what a one-turn prompt uses.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TRAINING_TEXTS = tuple(
    f"what is {i} plus {3 * i % 17}? the answer is \\boxed{{{i}}}." for i in range(300)
)


def train_bpe(*, byte_level: bool, vocab_size: int) -> Tokenizer:
    """A BPE tokenizer trained on `TRAINING_TEXTS` (and the chat format's text). Byte-level (as
    Qwen's: every string encodes, at 256 byte ids and more) or Metaspace over the characters it
    saw (small enough for the `tiny` model's 64 ids; unknown characters become `<unk>`)."""
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials, alphabet = list(SPECIAL_TOKENS), pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        specials, alphabet = ["<unk>", *SPECIAL_TOKENS], []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet
    )
    tok.train_from_iterator([*TRAINING_TEXTS, "user\nassistant\n"], trainer)
    return tok


def write_tokenizer_dir(
    directory,
    *,
    byte_level: bool = True,
    vocab_size: int = 320,
    template: str | None = CHAT_TEMPLATE,
    template_in_config: bool = False,
    config: dict | None = None,
    generation_eos: list[int] | None = None,
) -> str:
    """Writes `tokenizer.json`, `tokenizer_config.json` (EOS `<|im_end|>`, PAD `<|endoftext|>`,
    no BOS, plus `config`) and the chat template (`chat_template.jinja`, as transformers 5
    writes it, or inside the config with `template_in_config`) into `directory`; with
    `generation_eos`, a `generation_config.json` holding those eos ids. Returns the path."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    train_bpe(byte_level=byte_level, vocab_size=vocab_size).save(
        os.path.join(directory, "tokenizer.json")
    )
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **(config or {})}
    if template is not None and template_in_config:
        cfg["chat_template"] = template
    elif template is not None:
        with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
            f.write(template)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    if generation_eos is not None:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    return directory
