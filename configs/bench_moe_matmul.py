r"""FP4 MoE grouped matmul (Pallas) against bf16 `jax.lax.ragged_dot` at decode and prefill sizes
(experiments/bench_moe_matmul.py).

python -m experiments.bench_moe_matmul                                        # on the H200
python -m experiments.bench_moe_matmul --config.phases="(('prefill', 8192),)"
python -m experiments.bench_moe_matmul --config=configs/bench_moe_matmul.py:smoke   # CPU smoke run
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The paper-like expert layer on the H200; `arg="smoke"`: tiny sizes, one timed call."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per variant (numbers meaningless)
    c.format = "nvfp4"
    c.experts = 128  # G
    c.d_model = 2048  # K
    c.d_ff = 768  # N: one expert's gate / up projection
    c.top_k = 8
    c.phases = (("decode", 16), ("prefill", 4096))  # (name, tokens); rows M = tokens * top_k
    if arg == "smoke":
        c.smoke = True
        c.experts, c.d_model, c.d_ff, c.top_k = 4, 64, 64, 2
        c.phases = (("decode", 16), ("prefill", 64))
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
