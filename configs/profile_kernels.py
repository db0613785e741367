r"""Each FP4 kernel launched a few times at the shapes where its goal is missed, for a profiler
(experiments/profile_kernels.py).

ncu --kernel-name regex:'fp4_decode_attn|bf16_decode_attn|fp4_quantize' --launch-skip 2 \
    --launch-count 3 --set detailed --csv --page details \
    python -m experiments.profile_kernels > ncu_details.csv
python -m experiments.profile_kernels --config.context=131072
python -m experiments.profile_kernels --config=configs/profile_kernels.py:smoke   # CPU smoke run
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The paper-like attention shape at 32K and 65536 x 4096 quantize on the GPU;
    `arg="smoke"`: tiny shapes on the CPU in interpret mode (no profile)."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # tiny shapes on the CPU (the script's smoke run)
    c.launches = 5  # per kernel: the ncu command above skips 2 and profiles 3
    c.batch, c.heads, c.kv_heads, c.head_dim = 16, 32, 4, 128  # decode attention
    c.context = 32768
    c.rows, c.cols = 65536, 4096  # quantize + capture, bf16
    if arg == "smoke":
        c.smoke = True
        c.batch, c.heads, c.kv_heads, c.head_dim, c.context = 2, 4, 2, 64, 256
        c.rows, c.cols = 256, 256
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
