"""Verifiable reasoning tasks generated in code: tokenizer, generators, verifiers, splits.

Three tasks (`TaskKind`), each at difficulty levels 1-5, each problem a pure function of a seed:
multi-step arithmetic (`3+4*2-5=`), countdown (`40 from 3,12,7,4:`) and straight-line programs
(`a=3;b=a*2;c=b-1;?c`). A model sees `BOS prompt` and answers `reasoning > answer EOS`;
`reward` parses that and checks it exactly. `eval_split` gives the fixed held-out splits
(`SPLIT_NAMES`: "arith_countdown_l2", ..., named by task and level); `train_stream` never yields
their prompts.

Rollout settings that match: `SamplingConfig(stop_tokens=(EOS_ID,), pad_id=PAD_ID)`. The RL
pipeline reaches these tasks through `trace_jax.data` (the "synthetic" dataset kind, the
"synthetic" verifier and the "char" tokenizer), as one kind among file datasets and Hugging Face
tokenizers; this package imports nothing of it.
"""

from trace_jax.tasks.encoding import (
    SFTBatch,
    encode_prompts,
    encode_sft_batch,
    prompt_ids,
    solution_ids,
)
from trace_jax.tasks.problem import LEVELS, Problem, TaskKind
from trace_jax.tasks.registry import TASKS, check_answer, generate, is_well_formed, level_spec
from trace_jax.tasks.splits import (
    SPLIT_NAMES,
    SPLITS,
    SplitSpec,
    eval_split,
    eval_splits,
    held_out_prompts,
    split_stats,
    train_stream,
)
from trace_jax.tasks.tokenizer import (
    ANSWER_ID,
    ANSWER_MARKER,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER,
    VOCAB,
    VOCAB_SIZE,
    CharTokenizer,
)
from trace_jax.tasks.verify import (
    Score,
    batch_rewards,
    extract_answer,
    pass_at_1,
    pass_at_k,
    response_text,
    responses_from_rollout,
    reward,
    score,
)

__all__ = [
    "ANSWER_ID",
    "ANSWER_MARKER",
    "BOS_ID",
    "EOS_ID",
    "LEVELS",
    "PAD_ID",
    "SPLITS",
    "SPLIT_NAMES",
    "TASKS",
    "TOKENIZER",
    "VOCAB",
    "VOCAB_SIZE",
    "CharTokenizer",
    "Problem",
    "SFTBatch",
    "Score",
    "SplitSpec",
    "TaskKind",
    "batch_rewards",
    "check_answer",
    "encode_prompts",
    "encode_sft_batch",
    "eval_split",
    "eval_splits",
    "extract_answer",
    "generate",
    "held_out_prompts",
    "is_well_formed",
    "level_spec",
    "pass_at_1",
    "pass_at_k",
    "prompt_ids",
    "response_text",
    "responses_from_rollout",
    "reward",
    "score",
    "solution_ids",
    "split_stats",
    "train_stream",
]
