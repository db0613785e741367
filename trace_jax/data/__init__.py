"""The RL pipeline's data: tokenizers, prompt datasets and verifiers, each behind an interface with
implementations by kind, so that any tokenizer, dataset and verifier run through the same loop.

| interface       | kinds                                                                  |
| --------------- | ---------------------------------------------------------------------- |
| `Tokenizer`     | "char": the generated tasks' 52 ids; "hf": `HFTokenizer` (a directory) |
| `PromptDataset` | "synthetic": `SyntheticDataset`; "file": `FileDataset` (JSONL/Parquet) |
| `Verifier`      | "synthetic": `SyntheticVerifier`; "math": `MathVerifier` (math_verify) |

  tokenizer = load_tokenizer("hf", "/models/Qwen3-30B-A3B")
  dataset = FileDataset("gsm8k_train.jsonl", FileLayout(answer_extractor="gsm8k"))
  examples = dataset.step_examples(seed=0, step=12, n=8)       # a pure function of (seed, step)
  prompts, lengths = encode_prompts(examples, tokenizer=tokenizer, pad_to=256)
  rewards = compute_rewards(examples, responses, tokenizer=tokenizer, verifier=MathVerifier())

The generated tasks (`trace_jax.tasks`) are the layer below: their problems are examples, their
character tokenizer a `Tokenizer`; their `Score`, token batches (`encode_prompts`,
`encode_sft_batch`) and pass@k serve every kind and are exported here. `trace_jax.rl.TaskConfig`
names the kinds of a run.
"""

from trace_jax.data.datasets import (
    DATASET_KINDS,
    FileDataset,
    PromptDataset,
    SyntheticDataset,
    held_out_name,
    held_out_sets,
    make_dataset,
)
from trace_jax.data.examples import (
    ANSWER_EXTRACTORS,
    EXAMPLE_FILE_SUFFIXES,
    Example,
    FileLayout,
    TextExample,
    check_examples_path,
    last_boxed,
    read_examples,
)
from trace_jax.data.hf_tokenizer import HFTokenizer
from trace_jax.data.tokenizer import (
    TOKENIZER_KINDS,
    Tokenizer,
    check_tokenizer_dir,
    check_vocab,
    load_tokenizer,
)
from trace_jax.data.verifiers import (
    VERIFIER_KINDS,
    MathVerifier,
    SyntheticVerifier,
    Verifier,
    compute_rewards,
    make_verifier,
)
from trace_jax.tasks.encoding import SFTBatch, encode_prompts, encode_sft_batch
from trace_jax.tasks.tokenizer import pad_batch
from trace_jax.tasks.verify import Score, pass_at_1, pass_at_k, responses_from_rollout

__all__ = [
    "ANSWER_EXTRACTORS",
    "DATASET_KINDS",
    "EXAMPLE_FILE_SUFFIXES",
    "TOKENIZER_KINDS",
    "VERIFIER_KINDS",
    "Example",
    "FileDataset",
    "FileLayout",
    "HFTokenizer",
    "MathVerifier",
    "PromptDataset",
    "SFTBatch",
    "Score",
    "SyntheticDataset",
    "SyntheticVerifier",
    "TextExample",
    "Tokenizer",
    "Verifier",
    "check_examples_path",
    "check_tokenizer_dir",
    "check_vocab",
    "compute_rewards",
    "encode_prompts",
    "encode_sft_batch",
    "held_out_name",
    "held_out_sets",
    "last_boxed",
    "load_tokenizer",
    "make_dataset",
    "make_verifier",
    "pad_batch",
    "pass_at_1",
    "pass_at_k",
    "read_examples",
    "responses_from_rollout",
]
