r"""One decode step of the `small` preset: bf16 against FP4 W/A/KV (XLA and Pallas kernels), with
guidance capture off, compact and full (experiments/bench_decode_step.py).

python -m experiments.bench_decode_step                                        # on the H200
python -m experiments.bench_decode_step --config.implementations=pallas      # 5 contexts, ~5 min
python -m experiments.bench_decode_step --config.contexts=4096,8192
python -m experiments.bench_decode_step --config=configs/bench_decode_step.py:smoke  # CPU smoke run
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The `small` preset on the H200; `arg="smoke"`: the 1-block `tiny` model at context 64,
    one round of one call."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per variant (numbers meaningless)
    # ModelConfig.<preset>, with n_layers / head_dim replaced where set
    c.model = ml_collections.ConfigDict(
        {
            "preset": "small",
            "n_layers": ml_collections.config_dict.placeholder(int),
            "head_dim": ml_collections.config_dict.placeholder(int),
        }
    )
    c.recipe = "nvfp4"  # the FP4 W/A/KV recipe (trace_jax.quant.quant_recipe)
    c.batch = 16
    c.contexts = (4096, 8192, 32768, 65536, 131072)
    c.steps_per_call = 8  # decode steps in one jitted loop, as the sampler runs them
    # FP4 kernel implementations timed ("pallas" is required: capture is timed on it)
    c.implementations = ("xla", "pallas")
    c.rounds = 7  # alternating timing rounds of every variant per context
    c.inner = 2  # calls per trial
    c.trials = 3  # trials per round (their median is the round's time)
    if arg == "smoke":
        c.smoke = True
        c.model.preset, c.model.n_layers, c.model.head_dim = "tiny", 1, 32
        c.batch, c.contexts, c.steps_per_call = 2, (64,), 2
        c.rounds, c.inner, c.trials = 1, 1, 1
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
