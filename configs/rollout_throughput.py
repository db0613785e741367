r"""Rollout decode throughput (tokens/s) against output length: bf16, FP4, FP4 + guidance capture
(experiments/decode_throughput.py).

python -m experiments.decode_throughput                                        # H200: `small`
python -m experiments.decode_throughput --config.lengths=1024,8192 \
    --config.variants="('bf16', 'fp4 pallas')"     # strings with spaces: quoted, in a tuple
python -m experiments.decode_throughput --config=configs/decode_throughput.py:smoke  # CPU smoke
python -m experiments.decode_throughput --plot_from=experiments/results/decode_throughput.json
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The `small` preset, batch 16; `arg="smoke"`: the 2-block `tiny` model, 8 new tokens."""
    c = ml_collections.ConfigDict()
    c.smoke = False
    # ModelConfig.<preset>, with n_layers / head_dim replaced where set (random init)
    c.model = ml_collections.ConfigDict(
        {
            "preset": "small",
            "n_layers": ml_collections.config_dict.placeholder(int),
            "head_dim": ml_collections.config_dict.placeholder(int),
        }
    )
    c.format = "nvfp4"  # FP4 recipe of the FP4 variants (TRACE's rollout)
    c.lengths = (1024, 4096, 16384)  # output lengths (new tokens)
    c.variants = ("bf16", "fp4 xla", "fp4 pallas", "fp4 pallas + compact", "fp4 pallas + full")
    c.batch = 16  # sequences per rollout
    c.prompt_len = 64
    c.repeats = 2  # timed rollouts per variant, after one warm-up
    if arg == "smoke":
        c.smoke = True
        c.model.preset, c.model.n_layers, c.model.head_dim = "tiny", 2, 32
        c.lengths, c.batch, c.prompt_len, c.repeats = (8,), 2, 16, 1
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
