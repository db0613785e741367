"""Verifiable reasoning tasks generated in code: tokenizer, generators, verifiers, splits.

Four tasks (`TaskKind`), each at difficulty levels 1-5, each problem a pure function of a seed.
Three have worked solutions of at most about 100 tokens (`SHORT_TASKS`, the default mix):
multi-step arithmetic (`3+4*2-5=`), countdown (`40 from 3,12,7,4:`) and straight-line programs
(`a=3;b=a*2;c=b-1;?c`). One has long ones (`LONG_TASKS`): loop programs
(`a=47;b=8;do 60:a=a+b;b=a-31;?a`), traced iteration by iteration in 96-128 tokens at level 1 up
to 1536-2048 at level 5.
A model sees `BOS prompt` and answers `reasoning > answer EOS`; `reward` parses that and checks
it exactly. `eval_split` gives the fixed held-out splits (`SPLIT_NAMES`: "arith_countdown_l2",
..., "loop_l5", named by task and level); `train_stream` never yields their prompts.

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
from trace_jax.tasks.problem import LEVELS, LONG_TASKS, SHORT_TASKS, Problem, TaskKind
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
    "LONG_TASKS",
    "PAD_ID",
    "SHORT_TASKS",
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
