r"""FP4 decode attention over the packed cache (Pallas, a launch sweep) against the fastest bf16
decode attention: XLA einsum-softmax-einsum, our bf16 Pallas twin and jax's Pallas `gqa`
(experiments/bench_decode_attention.py).

python -m experiments.bench_decode_attention                                   # on the H200
python -m experiments.bench_decode_attention --config.contexts=32768,131072
python -m experiments.bench_decode_attention --config=configs/bench_decode_attention.py:smoke
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The H200 sweep; `arg="smoke"`: one tiny shape, the default launch, one timed call."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per variant (numbers meaningless)
    c.ceiling_bytes = 1 << 30  # bytes of the bandwidth-ceiling measurement
    c.format = "nvfp4"
    # (label, batch, query heads, kv heads, head_dim)
    c.shapes = (("paper-like", 16, 32, 4, 128), ("small preset", 16, 8, 2, 64))
    c.contexts = (4096, 8192, 32768, 65536, 131072)
    c.launch_sweep = True  # False: the api's default launch only
    # (shape label, context) points where a wider launch grid is timed too: where the goals are
    # set (the paper-like shape at 32K and 128K; the small preset's at 128K).
    c.tuned = (("paper-like", 32768), ("paper-like", 131072), ("small preset", 131072))
    c.jax_gqa_k_splits = (16, 64)  # jax's Pallas `gqa` (GPU only) at these k_splits
    if arg == "smoke":
        c.smoke = True
        c.ceiling_bytes = 1 << 20
        c.shapes = (("smoke", 2, 4, 2, 64),)
        c.contexts = (256,)
        c.launch_sweep = False
        c.tuned = ()
        c.jax_gqa_k_splits = ()
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
