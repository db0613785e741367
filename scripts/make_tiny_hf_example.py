r"""Writes the tiny example that `configs/hf_math.py` runs on the CPU, deterministic from a seed:

  python scripts/make_tiny_hf_example.py            # -> examples/ (what the repository ships)
  python scripts/make_tiny_hf_example.py --out /tmp/ex --seed 1

  <out>/data/generated_arith_train.jsonl   generated arithmetic word problems in the GSM8K
  <out>/data/generated_arith_eval.jsonl    layout ({"question", "answer": "... #### <n>"})
  <out>/hf_tiny/                           one directory as a Hugging Face download holds it:
    config.json, model.safetensors         a random Qwen3-MoE (`ModelConfig.tiny`'s widths, 2
                                           blocks, vocab = the tokenizer's), bf16 weights
    tokenizer.json                         a byte-level BPE trained on the problems
    tokenizer_config.json, chat_template.jinja, generation_config.json
                                           Qwen's special tokens, chat format and stop ids

The problems are made up here (names, items, numbers from the seed); no benchmark text is in
them. The model is random: it exercises the pipeline, it does not solve the problems.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import ml_dtypes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trace_jax.models import ModelConfig, init_model
from trace_jax.models.hf_checkpoint import save_hf_checkpoint

TRAIN_PROBLEMS, EVAL_PROBLEMS = 400, 100
VOCAB_SIZE = 512  # 256 byte symbols, the special tokens and about 250 merges
N_LAYERS = 2
# Qwen3's special tokens and one-turn chat format (its full template also handles tools and
# reasoning blocks, which these prompts never use).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana")
ITEMS = ("apple", "pencil", "marble", "card", "sticker", "cookie", "shell", "stamp")


def arithmetic_problem(rng: random.Random) -> dict[str, str]:
    """One word problem with a whole-number answer: {"question", "answer"}, the answer a worked
    solution ending in `#### <n>` (GSM8K's layout)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 9)
    match rng.randrange(5):
        case 0:
            q = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have?"
            n, work = a + b, f"{a} + {b} = {a + b}"
        case 1:
            a += b
            q = f"{name} has {a} {item}s and gives away {b}. How many {item}s are left?"
            n, work = a - b, f"{a} - {b} = {a - b}"
        case 2:
            q = f"A bag holds {b} {item}s. How many {item}s are in {c} bags?"
            n, work = b * c, f"{b} * {c} = {b * c}"
        case 3:
            q = f"{name} shares {b * c} {item}s equally among {c} friends. How many does each get?"
            n, work = b, f"{b * c} / {c} = {b}"
        case _:
            q = f"{name} buys {c} packs of {b} {item}s and loses {c}. How many {item}s are left?"
            n, work = b * c - c, f"{c} * {b} - {c} = {b * c - c}"
    return {"question": q, "answer": f"{work}, so the answer is {n}.\n#### {n}"}


def arithmetic_sets(seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval) problems, disjoint in their questions."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < TRAIN_PROBLEMS + EVAL_PROBLEMS:
        p = arithmetic_problem(rng)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out[:TRAIN_PROBLEMS], out[TRAIN_PROBLEMS:]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A byte-level BPE (as Qwen's: every string encodes) of `VOCAB_SIZE` ids on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_example(out: str, seed: int = 0) -> None:
    """Writes the data files and the model + tokenizer directory (module docstring) under
    `out`."""
    train, held_out = arithmetic_sets(seed)
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    for name, rows in (("train", train), ("eval", held_out)):
        with open(os.path.join(out, "data", f"generated_arith_{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    hf_dir = os.path.join(out, "hf_tiny")
    os.makedirs(hf_dir, exist_ok=True)
    chat = ["<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"]
    tok = train_tokenizer([p[k] for p in train for k in ("question", "answer")] + chat)
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    with open(os.path.join(hf_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    _write_json(
        os.path.join(hf_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 4096,
        },
    )
    stop_ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    _write_json(
        os.path.join(hf_dir, "generation_config.json"),
        {"eos_token_id": stop_ids, "pad_token_id": stop_ids[1], "do_sample": True},
    )
    cfg = ModelConfig.tiny(n_layers=N_LAYERS, vocab_size=tok.get_vocab_size())
    save_hf_checkpoint(hf_dir, init_model(cfg, seed=seed), dtype=ml_dtypes.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "examples"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_example(os.path.normpath(args.out), args.seed)
    print(f"wrote {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
