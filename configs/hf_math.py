r"""GRPO of a Hugging Face Qwen3-MoE checkpoint on math word problems from JSONL files, with
math_verify rewards, through the same loop and guidance store as the generated-task runs.

  python -m experiments.main --config=configs/hf_math.py --workdir=/tmp/hf_math
  python -m experiments.main --config=configs/hf_math.py --config.rl.method=fp4_qat
  python -m experiments.sft --config=configs/hf_math.py --workdir=/tmp/hf_math   # optional
  python -m experiments.main --config=configs/hf_math.py --workdir=/tmp/hf_math \
      --config.rl.init_from=/tmp/hf_math/sft_checkpoint

The defaults run on the CPU as they are: the shipped example `examples/` (written by
`scripts/make_tiny_hf_example.py`): a random 2-block Qwen3-MoE with its BPE tokenizer in
`examples/hf_tiny/`, and generated arithmetic word problems in GSM8K's layout (question; worked
answer ending in `#### <n>`), held-out evaluation on `generated_arith_eval.jsonl`. 10 steps take
about a minute on 2 CPU cores. The random model scores about 0: the run shows the pipeline
working, not learning. SFT is off by default (`experiments.sft` above adds it, then
`rl.init_from` starts GRPO from it: the answers are worked solutions).

`--config=configs/hf_math.py:qwen3_30b_a3b` is a starting point for a real run on 8 H200s
(experts split 8 ways; shapes not measured here): a downloaded Qwen3-30B-A3B directory (its
config.json, safetensors shards and tokenizer files in one directory) and GSM8K as JSONL:

  python -m experiments.main --config=configs/hf_math.py:qwen3_30b_a3b --workdir=/ckpt/rl \
      --config.model.hf_dir=/models/Qwen3-30B-A3B \
      --config.tasks.tokenizer_dir=/models/Qwen3-30B-A3B \
      --config.tasks.train_file=/data/gsm8k/train.jsonl \
      --config.eval.files="('/data/gsm8k/test.jsonl',)"

MATH (`problem`, `solution` with `\boxed{}`) instead: add `--config.tasks.question_field=problem
--config.tasks.answer_field=solution --config.tasks.solution_field=solution
--config.tasks.answer_extractor=boxed`. DAPO-Math-17k (Parquet): `question_field=prompt`,
`answer_field=reward_model.ground_truth`, `solution_field=` (none: no SFT), extractor `none`.
"""

import os

import ml_collections

from trace_jax.rl.experiment import experiment_config_dict

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
TINY_DIR = os.path.join(EXAMPLES, "hf_tiny")  # checkpoint and tokenizer, as a download holds them


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The shipped tiny example; `arg="qwen3_30b_a3b"`: the real run's sizes (module docstring)."""
    model = {"hf_dir": TINY_DIR}
    tasks = {
        "dataset": "file",
        "train_file": os.path.join(EXAMPLES, "data", "generated_arith_train.jsonl"),
        "question_field": "question",
        "answer_field": "answer",
        "solution_field": "answer",  # GSM8K's answers are worked solutions: SFT can use them
        "answer_extractor": "gsm8k",
        "tokenizer": "hf",
        "tokenizer_dir": TINY_DIR,
        "verifier": "math",
    }
    held_out = os.path.join(EXAMPLES, "data", "generated_arith_eval.jsonl")
    eval_ = {"splits": (), "files": (held_out,), "problems_per_split": 32, "max_new_tokens": 32}
    sft = {"steps": 200, "batch_size": 16, "log_every": 20}
    rl = {
        "method": "trace",
        "steps": 10,
        "prompts_per_step": 4,
        "group_size": 4,
        "max_new_tokens": 32,
        "learning_rate": 1e-4,  # tiny's (GRPOConfig's 1e-6 is the paper's at 30B)
        "eval_every": 10,
    }
    mesh = {}
    if arg == "qwen3_30b_a3b":
        model = {"hf_dir": "/models/Qwen3-30B-A3B", "grouped_matmul": "auto"}
        tasks |= {"train_file": "/data/gsm8k/train.jsonl", "tokenizer_dir": model["hf_dir"]}
        eval_ = {"splits": (), "files": ("/data/gsm8k/test.jsonl",), "problems_per_split": 256,
                 "max_new_tokens": 1024}  # fmt: skip
        sft = {"steps": 500, "batch_size": 64, "learning_rate": 1e-5, "log_every": 50}
        rl = {
            "method": "trace",
            "steps": 200,
            "prompts_per_step": 32,
            "group_size": 8,
            "max_new_tokens": 1024,
            "learning_rate": 1e-6,
            "warmup_steps": 10,
            "mini_batches": 2,
            "eval_every": 50,
            "checkpoint_every": 25,
            "mismatch_every": 25,
        }
        mesh = {"data": 1, "expert": 8}
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'qwen3_30b_a3b'")
    return experiment_config_dict(model=model, tasks=tasks, sft=sft, eval=eval_, rl=rl, mesh=mesh)
