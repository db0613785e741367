r"""Prefill attention over the KV cache: the flash kernel against the model's XLA attention at the
Qwen3-30B-A3B attention shapes (experiments/bench_prefill_attention.py).

python -m experiments.bench_prefill_attention                                     # on the H200
python -m experiments.bench_prefill_attention --config.shapes="((1, 8192, 256),)"
python -m experiments.bench_prefill_attention --config=configs/bench_prefill_attention.py:smoke

`tilings`: keyword dicts of the kernel (block_r, block_s, num_warps, num_stages), `{}` its
defaults; the fastest is timed beside XLA's attention in alternating rounds.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """32 query heads over 4 kv heads of 128 (Qwen3-30B-A3B), bf16; `arg="smoke"`: tiny."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per entry (numbers meaningless)
    c.kv_heads, c.q_per_kv, c.head_dim = 4, 8, 128
    # (rows, prompt tokens, new-token slots after them): a prefill chunk of whole prompts from
    # position 0 (the rollout's chunk of 8192 tokens: 1 x 8K or 8 x 1K) into a cache of
    # prompt + new slots.
    c.shapes = ((1, 8192, 256), (8, 1024, 256))
    c.tilings = (
        {},
        {"block_r": 64, "block_s": 64, "num_warps": 4},
        {"block_r": 128, "block_s": 128, "num_warps": 8, "num_stages": 2},
        {"block_r": 128, "block_s": 32, "num_warps": 4},
        {"block_r": 64, "block_s": 128, "num_warps": 4, "num_stages": 2},
    )
    c.dense_size = 8192  # the dense bf16 matmul [n, n] x [n, n] that sets the machine's rate
    c.rounds = 3
    if arg == "smoke":
        c.smoke = True
        c.kv_heads, c.q_per_kv, c.head_dim = 2, 2, 32
        c.shapes = ((2, 24, 8),)
        c.tilings = ({}, {"block_r": 16, "block_s": 16}, {"block_s": 48})  # the last one fails
        c.dense_size = 64
        c.rounds = 1
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
